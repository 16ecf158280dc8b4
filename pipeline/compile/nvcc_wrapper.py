"""Stand-in for nvcc in a build (``PYTORCH_NVCC``): hands the command to the build broker.

torch's cpp_extension writes ``nvcc = $PYTORCH_NVCC`` into the ninja file, so
every compile job of an unmodified setup.py comes here. The broker admits the
job when its predicted peak fits the memory budget, runs the real nvcc in a
cgroup of its own (re-running it if it is OOM-killed), and sends back the exit
status and output, which this process reproduces for ninja.

Standard library only, started with ``python -S -I``: many of these wait at
once, so each must stay small (about 10 MiB).
"""

import json
import os
import socket
import sys

SOCKET_ENV = "EYRIE_BUILD_SOCKET"


def main(argv: list[str]) -> int:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        sys.stderr.write(
            f"eyrie nvcc wrapper: {SOCKET_ENV} is not set; run the build through "
            "`eyrie build flash-attn` (or unset PYTORCH_NVCC to call nvcc directly)\n"
        )
        return 2
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(path)
        except OSError as exc:
            sys.stderr.write(f"eyrie nvcc wrapper: cannot reach the build broker at {path}: {exc}\n")
            return 2
        conn.sendall(json.dumps(request).encode() + b"\n")
        with conn.makefile("rb") as reply_stream:
            raw = reply_stream.readline()
    if not raw:
        sys.stderr.write("eyrie nvcc wrapper: the build broker closed the connection without a result\n")
        return 2
    reply = json.loads(raw)
    sys.stdout.write(reply.get("stdout", ""))
    sys.stderr.write(reply.get("stderr", ""))
    return int(reply["exit"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
