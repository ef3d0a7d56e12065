"""nginx in front of eagleserve replicas on this machine, from the shipped deploy/nginx.conf
(only the replica lines, the port and the file paths rewritten), for tests and benchmarks."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "deploy", "nginx.conf")
APT_TIMEOUT_S = 600


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )


def ensure_nginx() -> tuple[str | None, str]:
    """(path of nginx, "") or (None, why not): Debian's package is installed with apt-get when
    nginx is absent and this process may (root)."""
    found = find_nginx()
    if found:
        return found, ""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, "nginx is not installed, and apt-get cannot install it here (not root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "nginx"]
    for cmd in (install, ["apt-get", "update"], install):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=APT_TIMEOUT_S,
                                  env=env)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None, f"`{' '.join(cmd)}` timed out"
        if cmd is install and proc.returncode == 0 and find_nginx():
            return find_nginx(), ""
    return None, f"apt-get could not install nginx: {proc.stderr.strip()[-300:]}"


def render_conf(replicas: list[str], port: int, root: str) -> str:
    """deploy/nginx.conf for these replicas (host:port), listening on 127.0.0.1:`port`, with
    its pid, logs and temp files under `root` (so it runs without root)."""
    out = []
    for line in open(CONF).read().splitlines():
        marker = line.partition("# eagleserve: ")[2].strip()
        indent = line[: len(line) - len(line.lstrip())]
        if marker == "replica":
            if out[-1].strip().startswith("server ") and "max_fails" in out[-1]:
                continue  # replaced by the first replica line, below
            out += [f"{indent}server {r} max_fails=2 fail_timeout=10s;" for r in replicas]
        elif marker == "listen":
            out.append(f"{indent}listen 127.0.0.1:{port};")
        elif marker == "pid":
            out.append(f"pid {root}/nginx.pid;")
        elif marker == "error_log":
            out.append(f"error_log {root}/error.log warn;")
        elif marker == "access_log":
            out.append(f"{indent}access_log {root}/access.log;")
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
                out.append(f"{indent}{kind}_temp_path {root}/{kind};")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Nginx:
    """nginx in the foreground over `replicas`; `url` is where it listens; `stop()` ends it."""

    def __init__(self, binary: str, replicas: list[str]) -> None:
        self.root = tempfile.mkdtemp(prefix="eagleserve-nginx-")
        port = free_port()
        conf = os.path.join(self.root, "nginx.conf")
        with open(conf, "w") as f:
            f.write(render_conf(replicas, port, self.root))
        cmd = [binary, "-p", self.root, "-c", conf, "-g", "daemon off;"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    self.stop()
                    raise RuntimeError(f"nginx did not start: {err[-2000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
