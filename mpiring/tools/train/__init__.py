"""The data-parallel training job behind ``python -m mpiring train`` (library side).

``data`` reads the corpus and cuts it into windows; ``loop`` builds a job
(model, wrapper for the chosen mode, optimizer, sharded data) and runs it. The
CLI in ``mpiring.cli.train`` only parses flags and prints.
"""
