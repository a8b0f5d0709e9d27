"""A cold `dlm-jax serve`: how long until it is ready, what its first requests take, and when
every program it has met is built in full; compiled in full against a tiered compile
(`DLM_JAX_COMPILE`), in each way of reading the cache (`DLM_JAX_ATTENTION`).

    .venv/bin/python benchmarks/serve_start.py [--model models/llada-tiny] [--compiles full tiered]
        [--attention gather split] [--requests 8] [--gen N] [--max-batch N] [--build-timeout 600]
        --out PATH

Each setting: a fresh server process (`dlm-jax serve --port 0`, warmed up before it reports
ready) over an empty persistent compile cache of its own. Ready s: from the process's start to
its `ready:` line (the line's own count of programs, those compiled quick and those left to
build behind, is recorded). Then `--requests` held-out task prompts, one at a time, greedy
(the first pass: under a tiered compile, on quick programs and in wider windows' programs);
then /metrics is polled until no full compile is pending (`dlm_jax_compiles_pending`, at most
`--build-timeout` s: built s, from the ready line) and the same requests go again (the second
pass). Every setting's answers are compared with the first setting's first pass; the server
must exit 0 on SIGTERM with no traceback in its log. The same machine runs every setting, one
after another; nothing else should run beside it.

Prints JSON lines, progress on stderr; writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.batching import prompt_texts  # noqa: E402
from benchmarks.serve import Server  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)

READY = re.compile(r"ready: (\d+) programs built in ([\d.]+) s(?: \((.*)\))?$")


def _log(msg: str) -> None:
    print(f"[serve_start.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ready_counts(line: str) -> dict:
    """The ready line's figures: programs, seconds, compiled quick, left to build behind."""
    m = READY.match(line.strip())
    if m is None:
        raise ValueError(f"not a ready line: {line!r}")
    rest = m.group(3) or ""
    quick = re.search(r"(\d+) compiled quick", rest)
    behind = re.search(r"(\d+) more build behind", rest)
    return {"programs": int(m.group(1)), "warmup_seconds": float(m.group(2)),
            "quick": int(quick.group(1)) if quick else 0, "behind": int(behind.group(1)) if behind else 0}


def metrics(client, url: str) -> dict[str, float]:
    """The server's dlm_jax_* gauges and counters by name (samples without labels)."""
    out = {}
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        if m := re.match(r"(dlm_jax_\w+) (\S+)$", line):
            out[m.group(1)] = float(m.group(2))
    return out


def one_pass(client, url: str, name: str, texts: list[str], gen: int | None) -> tuple[list[str], list[float]]:
    answers, seconds = [], []
    for text in texts:
        body = {"model": name, "prompt": text, "temperature": 0, **({"max_tokens": gen} if gen else {})}
        t = time.perf_counter()
        r = client.post(url + "/v1/completions", json=body, timeout=600)
        seconds.append(round(time.perf_counter() - t, 4))
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code} from the server: {r.text[:300]}")
        answers.append(r.json()["choices"][0]["text"])
    return answers, seconds


def run_setting(args, compile: str, attention: str, texts: list[str], work: Path) -> dict:
    import httpx

    cache = work / f"xla-{compile}-{attention}"
    cmd = [sys.executable, "-m", "dlm_jax.frontends.cli", "serve", "--model", str(args.model), "--port", "0",
           *(["--gen", str(args.gen)] if args.gen else []),
           *(["--max-batch", str(args.max_batch)] if args.max_batch else [])]
    env = {"DLM_JAX_COMPILE": compile, "DLM_JAX_ATTENTION": attention, "DLM_JAX_CACHE_DIR": str(cache),
           "JAX_COMPILATION_CACHE_DIR": str(cache)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # (the server's process takes this environment)
    t0 = time.perf_counter()
    try:
        server = Server(cmd, work / f"server-{compile}-{attention}.log", timeout=args.build_timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ready_s = time.perf_counter() - t0
    line = next(x for x in server.lines if x.startswith("ready: "))
    record = {"compile": compile, "attention": attention, "ready_seconds": round(ready_s, 2), **ready_counts(line),
              "ready_line": line}
    _log(f"{compile} / {attention}: {line} ({ready_s:.1f} s from start)")
    try:
        with httpx.Client() as client:
            name = client.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            first, first_s = one_pass(client, server.url, name, texts, args.gen)
            after_first = metrics(client, server.url)
            t = time.perf_counter()
            while metrics(client, server.url).get("dlm_jax_compiles_pending", 0) > 0:
                if time.perf_counter() - t > args.build_timeout:
                    break
                time.sleep(0.5)
            done = metrics(client, server.url).get("dlm_jax_compiles_pending", 0) == 0
            record["built_seconds"] = round(time.perf_counter() - t0, 2) if done else None
            second, second_s = one_pass(client, server.url, name, texts, args.gen)
    finally:
        rc = server.stop()
    record.update(first_pass_seconds=first_s, second_pass_seconds=second_s,
                  first_pass_total=round(sum(first_s), 3), second_pass_total=round(sum(second_s), 3),
                  steps_widened_first_pass=int(after_first.get("dlm_jax_steps_widened", 0)),
                  quick_after_first_pass=int(after_first.get("dlm_jax_programs_quick", 0)),
                  pending_after_first_pass=int(after_first.get("dlm_jax_compiles_pending", 0)),
                  answers=first, second_pass_same=first == second, server_exit_code=rc,
                  server_log_tracebacks=server.tracebacks())
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "llada-tiny")
    p.add_argument("--compiles", nargs="+", choices=("full", "tiered"), default=["full", "tiered"])
    p.add_argument("--attention", nargs="+", default=["gather", "split"],
                   help="the executor's ways of reading the cache (DLM_JAX_ATTENTION), each a setting")
    p.add_argument("--requests", type=int, default=8, help="requests per pass, one at a time")
    p.add_argument("--gen", type=int, default=None, help="the server's --gen and each request's max_tokens")
    p.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch")
    p.add_argument("--build-timeout", type=float, default=600.0,
                   help="seconds to wait for the server to be ready, and then for its compiles behind")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    texts = prompt_texts(args.requests)
    runs = []
    with tempfile.TemporaryDirectory(prefix="serve_start_") as tmp:
        work = Path(tmp)
        for attention in args.attention:
            for compile in args.compiles:
                runs.append(run_setting(args, compile, attention, texts, work))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "answers"}), flush=True)
        shutil.rmtree(work, ignore_errors=True)
    reference = runs[0]["answers"]
    for r in runs:
        r["same_as_first_setting"] = r["answers"] == reference
    rep = {"benchmark": "benchmarks/serve_start.py", "model": str(args.model.relative_to(ROOT)
                                                                   if args.model.is_relative_to(ROOT) else args.model),
           "requests": args.requests, "gen": args.gen, "max_batch": args.max_batch,
           "machine": f"{platform.node()} ({os.cpu_count()} CPU cores)", "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(["benchmarks/serve_start.py",
                                                                                   *(argv or sys.argv[1:])]),
           "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), rep, indent=1)
    atomic_write(args.out.with_suffix(".md"), markdown(rep).encode())
    atomic_write(args.out.with_suffix(".png"), plot(rep))
    print(markdown(rep))
    return 0 if all(r["server_exit_code"] == 0 and not r["server_log_tracebacks"] for r in runs) else 1


def markdown(rep: dict) -> str:
    lines = [f"# A cold `dlm-jax serve` (`benchmarks/serve_start.py`): {rep['model']}", "",
             f"Written by `{rep['command']}` on {rep['machine']}, Python {rep['python']}, {rep['date']}. Each "
             f"setting a fresh server over an empty compile cache; {rep['requests']} greedy requests one at a time "
             "right after its ready line (first pass), then again once no full compile is pending (second "
             "pass). Ready s: from the process's start. Built s: from the process's start to no compile pending "
             "(under a full compile, the warm-up built everything). Same: each pass's answers against the first "
             "setting's first pass.", "",
             "| compile | attention | ready s | programs at ready (quick / left behind) | first pass s | steps widened "
             "| built s | second pass s | same answers | exit |", "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rep["runs"]:
        built = "-" if r.get("built_seconds") is None else f"{r['built_seconds']:.1f}"
        lines.append(f"| {r['compile']} | {r['attention']} | {r['ready_seconds']:.1f} | {r['programs']} "
                     f"({r['quick']} / {r['behind']}) | {r['first_pass_total']:.2f} | {r['steps_widened_first_pass']} "
                     f"| {built} | {r['second_pass_total']:.2f} | {r['same_as_first_setting'] and r['second_pass_same']} "
                     f"| {r['server_exit_code']}{'' if not r['server_log_tracebacks'] else ' (tracebacks)'} |")
    return "\n".join(lines) + "\n"


def plot(rep: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._plots import png_bytes

    runs = rep["runs"]
    labels = [f"{r['compile']} / {r['attention']}" for r in runs]
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(runs) + 1.6))
    y = range(len(runs))
    ready = [r["ready_seconds"] for r in runs]
    first = [r["first_pass_total"] for r in runs]
    ax.barh(y, ready, color="#888888", label="until ready")
    ax.barh(y, first, left=ready, color="#4c72b0", label=f"first pass ({rep['requests']} requests)")
    built = [(i, r["built_seconds"]) for i, r in enumerate(runs) if r.get("built_seconds") is not None]
    if built:
        ax.plot([s for _, s in built], [i for i, _ in built], ls="", marker="|", ms=18, color="#c44e52",
                label="no compile pending")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the server's start")
    ax.set_title(f"a cold dlm-jax serve: {rep['model']}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return png_bytes(fig)


if __name__ == "__main__":
    raise SystemExit(main())
