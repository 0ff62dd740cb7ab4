"""Beside the pure floor: the watchdog (deadlines and stall reports), the step trace
and host pages. The backends stamp every blocking call into the watchdog's record."""
