"""`make lab`: JupyterLab on this project's kernel, bound to localhost, as root or as an ordinary user.

    python scripts/lab.py [--port 8888] [--token TOKEN]

It opens the repository's root, where two folders hold the notebooks:
- figures/notebooks/: the executed notebooks that `make repro` published (committed): read the results there;
- notebooks/: the parameterized sources. Run one top to bottom on the kernel "Python (lowmem)" and it resolves
  params.yaml at the smoke profile, writing to data/smoke/, never to figures/.

The server replaces this process (exec), so its process id is this command's, and Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "lowmem"
READ, RERUN = "figures/notebooks", "notebooks"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def command(port: int, token: str) -> list[str]:
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}", f"--MultiKernelManager.default_kernel_name={KERNEL}"]
    if os.geteuid() == 0:  # JupyterLab refuses root without it, and most containers run as root
        cmd.append("--allow-root")
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8888)
    ap.add_argument("--token", default=None, help="the server's token (default: a new random one)")
    args = ap.parse_args(argv)
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        import jupyterlab  # noqa: F401
    except ImportError:
        print(f"error: JupyterLab is not installed in {sys.executable}; run `make setup` first", file=sys.stderr)
        return 2
    if KERNEL not in KernelSpecManager().find_kernel_specs():
        print(f"error: the kernel '{KERNEL}' is not registered for {sys.executable}; run `make setup` first", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"error: --port must be in 1..65535, not {args.port}", file=sys.stderr)
        return 2
    if not port_free(args.port):
        print(f"error: port {args.port} on 127.0.0.1 is in use (another JupyterLab?); run `make lab PORT=<free port>`", file=sys.stderr)
        return 2
    token = args.token or secrets.token_hex(24)
    print(f"JupyterLab at http://127.0.0.1:{args.port}/lab?token={token}\n"
          f"  read the results: {READ}/ (executed by `make repro`, committed)\n"
          f"  rerun a study:    {RERUN}/ (parameterized sources; kernel \"Python (lowmem)\"; smoke profile, writes data/smoke/)\n"
          f"  stop: Ctrl-C", flush=True)
    cmd = command(args.port, token)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
