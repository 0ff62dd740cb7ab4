# Sourced by every launch script that takes a hostfile, BEFORE anything else runs:
# checks $HOSTFILE (when set) and puts the launcher's arguments in HOSTARGS.
#   HOSTFILE=hostfiles/mpich-localhost scripts/demo.sh
# A relative path is taken from the current directory, else from the repository
# root; it is made absolute because the scripts then change to the root.
HOSTARGS=()
if [ -n "${HOSTFILE:-}" ]; then
    _me="scripts/$(basename "$0")"
    _root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [ ! -e "$HOSTFILE" ] && [ "${HOSTFILE#/}" = "$HOSTFILE" ] && [ -e "$_root/$HOSTFILE" ]; then
        HOSTFILE="$_root/$HOSTFILE"
    fi
    if [ ! -e "$HOSTFILE" ]; then
        echo "$_me: hostfile '$HOSTFILE' does not exist: pass an existing file (see hostfiles/), or unset HOSTFILE to run on this machine" >&2
        exit 2
    elif [ ! -f "$HOSTFILE" ]; then
        echo "$_me: hostfile '$HOSTFILE' is not a regular file: pass a file with one 'host:slots' line per machine (see hostfiles/)" >&2
        exit 2
    elif [ ! -r "$HOSTFILE" ]; then
        echo "$_me: hostfile '$HOSTFILE' is not readable: fix its permissions (chmod u+r)" >&2
        exit 2
    elif ! grep -qv '^[[:space:]]*\(#.*\)\?$' "$HOSTFILE"; then
        echo "$_me: hostfile '$HOSTFILE' lists no host: add one 'host:slots' line per machine (see hostfiles/)" >&2
        exit 2
    fi
    HOSTFILE="$(cd "$(dirname "$HOSTFILE")" && pwd)/$(basename "$HOSTFILE")"
    HOSTARGS=(-f "$HOSTFILE")  # MPICH's mpiexec; Open MPI's mpirun takes --hostfile
    unset _me _root
fi
