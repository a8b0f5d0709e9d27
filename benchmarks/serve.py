"""`dlm-jax serve` under open-loop load, against fixed batches: throughput, time to first chunk
and latency at rising Poisson arrival rates, a fault mix, and a soak's resident memory.

    .venv/bin/python benchmarks/serve.py [--small] [--model models/llada-12m] [--max-batch 16]
        [--gen 128] [--rates 2 4 6 8 10 12 14 16 20 24 32] [--n 80] [--soak 1000] [--soak-rate 6]
        [--p99-bound 2.0] [--out benchmarks/results/serve]

One run, three parts ([docs/serve.md](../docs/serve.md), [docs/engine.md](../docs/engine.md)):

- references: every prompt decoded alone in this process (`Decoder.decode([prompt])`, the
  server's decode config); a few also sent alone to the idle server, which must answer the same.
- fixed: the previous generation, in this process with no server running: requests queued as
  they arrive and decoded `--max-batch` at a time (`Decoder.decode`), each batch until its
  slowest request is done (benchmarks/batching.py's fixed server). Seconds exclude compile waits.
- serve: the real server (`dlm-jax serve --port 0 --max-batch B`, its persistent compile cache,
  warmed up before /health answers 200) and an asyncio client (httpx) sending streaming
  `/v1/completions` requests at Poisson arrival times, open loop: a request is sent at its time
  whatever the server's state, and its latency counts from that time.

Both servers get the same requests at the same arrival times, rate by rate, until a rate breaks
the server (p99 latency over `--break-factor` times its p99 at the first rate, or completions
falling behind: achieved requests/s under 0.8 of offered); the breaking rate is the last one
measured. Of every 20 requests, 2 disconnect after their first chunk (10%) and 1 is malformed
(5%), cycling through `BAD_CLASSES`; the fixed server decodes the disconnecting ones to the
end (it cannot cancel) and never sees the malformed ones. Figures are over the well-formed
requests that stayed: throughput = their completion tokens over the span from the phase's
first arrival to its last completion; latency = arrival to `data: [DONE]` (fixed: to its
batch's end); time to first chunk = arrival to the first text chunk (fixed: its batch's start
plus the batch's first block). Wrong: a completion whose text or token count differs from the
reference; lost: no `[DONE]`; 5xx: a 5xx status or an error object in the stream.

Throughput at equal p99 latency: for a bound L, each server's sustained throughput is the
highest completion tokens/s among its measured rates whose p99 latency is at most L and whose
completions kept up (achieved over offered requests/s at least 0.8); the ratio is serve's over
fixed's, reported for L in `BOUNDS` and `--p99-bound` (the headline).

Soak: `--soak` requests at `--soak-rate`/s with the same fault mix, the server's resident
memory (psutil) sampled every 0.5 s; growth = (highest RSS after the first 10% of the requests
completed - RSS then) / RSS then.

Prints JSON lines, progress on stderr; writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.batching import _pct, _prompts, _trim, fixed_batches  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)

BAD_CLASSES = ("malformed_json", "unknown_field", "wrong_type", "prompt_too_long", "max_tokens_out_of_range",
               "unknown_preset", "non_utf8", "body_10mb")
BOUNDS = (0.5, 1.0, 2.0, 5.0)
PERIOD = 20  # of every PERIOD requests: index DISCONNECT disconnect early, BAD is malformed
DISCONNECT = (3, 13)
BAD = 10
KEPT_UP = 0.8  # achieved requests/s over offered below this: the server fell behind


def _log(msg: str) -> None:
    print(f"[serve.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the workload


def workload(rates, n: int, soak: int, soak_rate: float, pool: int) -> list[dict]:
    """Phases of requests: each {label, rate, reqs: [{i, arrival, kind, prompt, bad}]}, the
    request index `i` counting over the whole run (it picks the kind and the prompt)."""
    rng = np.random.default_rng(1)
    phases, i = [], 0
    for label, rate, count in [(f"{r:g}/s", r, n) for r in rates] + [("soak", soak_rate, soak)]:
        gaps = rng.exponential(1.0 / rate, count)
        arrivals = np.cumsum(gaps) - gaps[0]
        reqs = []
        for a in arrivals:
            k = i % PERIOD
            kind = "bad" if k == BAD else "disconnect" if k in DISCONNECT else "ok"
            reqs.append({"i": i, "arrival": float(a), "kind": kind, "prompt": i % pool,
                         "bad": BAD_CLASSES[(i // PERIOD) % len(BAD_CLASSES)] if kind == "bad" else None})
            i += 1
        phases.append({"label": label, "rate": rate, "reqs": reqs})
    return phases


def bad_body(kind: str, name: str, max_len: int) -> bytes:
    """A request body of malformed class `kind`."""
    ok = {"model": name, "prompt": "1+1=", "stream": True}
    if kind == "malformed_json":
        return b'{"model": "' + name.encode() + b'", "prompt": [1, 2'
    if kind == "unknown_field":
        return json.dumps({**ok, "frobnicate": True}).encode()
    if kind == "wrong_type":
        return json.dumps({**ok, "max_tokens": "sixty-four"}).encode()
    if kind == "prompt_too_long":
        return json.dumps({**ok, "prompt": [65] * (max_len + 64)}).encode()
    if kind == "max_tokens_out_of_range":
        return json.dumps({**ok, "max_tokens": 10**7}).encode()
    if kind == "unknown_preset":
        return json.dumps({**ok, "dlm_jax": {"preset": "no-such-preset"}}).encode()
    if kind == "non_utf8":
        return b'{"model": "' + name.encode() + b'", "prompt": "\xff\xfe\xfa"}'
    if kind == "body_10mb":
        return json.dumps({**ok, "prompt": "a" * (10 << 20)}).encode()
    raise ValueError(f"unknown bad-input class {kind!r}")


# ---------------------------------------------------------------------------- fixed batches


def run_fixed(decoder, cfg, prompts, arrivals, b: int) -> list[dict]:
    """benchmarks/batching.py's fixed server (`fixed_batches`). Per request: tokens, latency
    and time to first chunk, seconds since its arrival."""
    eos = set(decoder.model_config.eos_ids)
    out = [None] * len(prompts)
    for batch, res, _, end, first in fixed_batches(decoder, cfg, prompts, arrivals, b):
        for j, i in enumerate(batch):
            out[i] = {"tokens": _trim(res.sequences[j], eos), "done": end, "latency": end - arrivals[i],
                      "ttfc": max(0.0, first - arrivals[i])}
    return out


# ---------------------------------------------------------------------------- the server


class Server:
    """`dlm-jax serve` as a subprocess: its URL from stdout, its warm-up, its pid for psutil."""

    def __init__(self, cmd: list[str], log_path: Path, timeout: float = 600.0):
        self.cmd = cmd
        self.log_path = log_path
        self.err = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.err, env=env, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self.warmup: dict | None = None
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        with self._seen:
            while self.warmup is None:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready; "
                                       f"see {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready within {timeout:g} s")
                self._seen.wait(0.5)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                if m := re.search(r"on (http://\S+)", line):
                    self.url = m.group(1)
                if m := re.match(r"ready: (\d+) programs built in ([\d.]+) s", line):
                    self.warmup = {"programs": int(m.group(1)), "seconds": float(m.group(2))}
                self._seen.notify_all()

    def stop(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.err.close()
        return rc

    def tracebacks(self) -> int:
        return self.log_path.read_text(errors="replace").count("Traceback")


async def _get_json(client, url: str) -> tuple[int, dict]:
    r = await client.get(url)
    return r.status_code, r.json()


async def _wait_healthy(client, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get(url + "/health")).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout:g} s")


async def one_request(client, url: str, name: str, req: dict, prompt: list[int], t0: float,
                      bad: dict[str, bytes], max_tokens: int, timeout: float) -> dict:
    """Send `req` at its arrival time (open loop) and record what came back."""
    delay = t0 + req["arrival"] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    rec = {"i": req["i"], "kind": req["kind"], "bad": req["bad"], "sent_late": round(sent - t0 - req["arrival"], 4)}
    headers = {"content-type": "application/json"}
    if req["kind"] == "bad":
        try:
            r = await client.post(url + "/v1/completions", content=bad[req["bad"]], headers=headers, timeout=timeout)
            rec["status"] = r.status_code
            rec["seconds"] = time.perf_counter() - sent
            try:
                err = r.json().get("error") or {}
                rec["message"] = str(err.get("message", ""))[:160]
            except ValueError:
                rec["message"] = None  # not an OpenAI error object
        except Exception as e:  # noqa: BLE001 - counted, never raised
            rec.update(status=None, seconds=time.perf_counter() - sent, message=f"client error: {type(e).__name__}")
        return rec
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, errors, done, first = [], None, [], False, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers,
                                 timeout=timeout) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                errors.append(r.text[:200])
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        errors.append(obj["error"].get("message", "")[:200])
                        rec["stream_error"] = obj["error"].get("type") or True
                        continue
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj.get("choices", []):
                        if ch.get("text"):
                            text.append(ch["text"])
                            if first is None:
                                first = time.perf_counter() - sent
                    if req["kind"] == "disconnect" and text:
                        break  # leave mid-stream: closing the response drops the connection
    except Exception as e:  # noqa: BLE001 - a lost request, counted
        errors.append(f"client error: {type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    rec.update(done=done, text="".join(text), completion_tokens=(usage or {}).get("completion_tokens"),
               latency=end - t0 - req["arrival"], ttfc=None if first is None else first + rec["sent_late"],
               end=end - t0, errors=errors)
    return rec


async def run_phase(url: str, name: str, phase: dict, pool: list[list[int]], bad: dict[str, bytes],
                    max_tokens: int, *, timeout: float, rss=None) -> tuple[list[dict], list]:
    """One phase's requests against the server; with `rss` (a psutil.Process), its resident
    memory every 0.5 s with the completions so far."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    samples: list[tuple[float, int, int]] = []
    finished = [0]
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter() + 0.2

        async def tracked(req):
            rec = await one_request(client, url, name, req, pool[req["prompt"]], t0, bad, max_tokens, timeout)
            finished[0] += 1
            return rec

        async def sample():
            while True:
                samples.append((round(time.perf_counter() - t0, 3), rss.memory_info().rss, finished[0]))
                await asyncio.sleep(0.5)

        sampler = asyncio.ensure_future(sample()) if rss is not None else None
        try:
            recs = await asyncio.gather(*(tracked(r) for r in phase["reqs"]))
        finally:
            if sampler is not None:
                sampler.cancel()
        if rss is not None:
            samples.append((round(time.perf_counter() - t0, 3), rss.memory_info().rss, finished[0]))
        # Rows freed: once idle, nothing runs or waits (disconnected requests included).
        idle = None
        for _ in range(50):
            _, h = await _get_json(client, url + "/health")
            idle = {"running": h["running"], "waiting": h["waiting"]}
            if not h["running"] and not h["waiting"]:
                break
            await asyncio.sleep(0.1)
    arrivals = {r["i"]: r["arrival"] for r in phase["reqs"]}
    for rec in recs:
        rec["arrival"] = arrivals[rec["i"]]
    return list(recs), samples, idle


# ---------------------------------------------------------------------------- figures


def serve_summary(phase: dict, recs: list[dict], refs: dict[int, dict], pool_of: dict[int, int]) -> dict:
    ok = [r for r in recs if r["kind"] == "ok"]
    good, wrong, lost, five, refused, examples = [], 0, 0, 0, 0, []
    for r in ok:
        status = r.get("status")
        if status is not None and status >= 500 or r.get("stream_error"):
            five += 1
        if status == 429:
            refused += 1
            continue
        if not r["done"]:
            lost += 1
            if len(examples) < 3:
                examples.append({"i": r["i"], "status": status, "errors": r["errors"]})
            continue
        ref = refs[pool_of[r["i"]]]
        if r["text"] != ref["text"] or r["completion_tokens"] != len(ref["tokens"]):
            wrong += 1
            if len(examples) < 3:
                examples.append({"i": r["i"], "got": r["text"][:80], "want": ref["text"][:80]})
            continue
        good.append(r)
    disc = [r for r in recs if r["kind"] == "disconnect"]
    disc_5xx = sum(1 for r in disc if (r.get("status") or 0) >= 500 or r.get("stream_error"))
    bad = [r for r in recs if r["kind"] == "bad"]
    s = _figures("serve", phase, [(r["arrival"], r["arrival"] + r["latency"], r["ttfc"], r["completion_tokens"])
                                  for r in good])
    s.update(requests=len(recs), well_formed=len(ok), completed=len(good), wrong=wrong, lost=lost,
             server_errors=five + disc_5xx, refused_429=refused, disconnected=len(disc),
             disconnect_errors=[r["errors"] for r in disc if r["errors"]][:3],
             bad=len(bad), bad_4xx=sum(1 for r in bad if r.get("status") and 400 <= r["status"] < 500),
             bad_ms_max=round(1000 * max((r["seconds"] for r in bad), default=0.0), 1),
             sent_late_max=round(max(r["sent_late"] for r in recs), 4), problems=examples)
    return s


def fixed_summary(phase: dict, out: list[dict], idx: list[int], refs, pool_of) -> dict:
    """Figures over the requests that did not disconnect (the fixed server decoded those too)."""
    kinds = {r["i"]: r["kind"] for r in phase["reqs"]}
    arrivals = {r["i"]: r["arrival"] for r in phase["reqs"]}
    rows = [(arrivals[i], arrivals[i] + o["latency"], o["ttfc"], len(o["tokens"]), i, o["tokens"])
            for i, o in zip(idx, out) if kinds[i] == "ok"]
    s = _figures("fixed", phase, [r[:4] for r in rows])
    s.update(requests=len(out), completed=len(rows),
             differs_from_solo=sum(1 for r in rows if r[5] != refs[pool_of[r[4]]]["tokens"]))
    return s


def _figures(server: str, phase: dict, rows: list[tuple]) -> dict:
    """rows: (arrival, done, ttfc, completion tokens) per request."""
    if not rows:
        return {"server": server, "phase": phase["label"], "offered_rps": phase["rate"]}
    first = min(r["arrival"] for r in phase["reqs"])
    last_arrival = max(r[0] for r in rows)
    span = max(r[1] for r in rows) - first
    lat = [r[1] - r[0] for r in rows]
    ttfc = [r[2] if r[2] is not None else r[1] - r[0] for r in rows]
    tokens = sum(r[3] for r in rows)
    offered = len(rows) / max(last_arrival - first, 1e-9)
    achieved = len(rows) / max(span, 1e-9)
    return {"server": server, "phase": phase["label"], "offered_rps": phase["rate"], "seconds": round(span, 3),
            "tokens_per_second": round(tokens / span, 2), "requests_per_second": round(achieved, 3),
            "achieved_over_offered": round(achieved / offered, 3), "completion_tokens": tokens,
            "latency_p50": _pct(lat, 50), "latency_p99": _pct(lat, 99),
            "ttfc_p50": _pct(ttfc, 50), "ttfc_p99": _pct(ttfc, 99)}


def broken(row: dict, first: dict, factor: float) -> bool:
    return (row["latency_p99"] > factor * first["latency_p99"]) or row["achieved_over_offered"] < KEPT_UP


def sustained(rows: list[dict], bound: float) -> float | None:
    """The highest tokens/s of a rate whose p99 latency is within `bound` and whose completions
    kept up with the arrivals (a short phase can fall behind before its p99 shows it)."""
    ok = [r["tokens_per_second"] for r in rows if r.get("latency_p99") is not None and r["latency_p99"] <= bound
          and r["achieved_over_offered"] >= KEPT_UP]
    return max(ok) if ok else None


def ratios(serve_rows, fixed_rows, bounds) -> list[dict]:
    out = []
    for b in bounds:
        s, f = sustained(serve_rows, b), sustained(fixed_rows, b)
        out.append({"p99_bound": b, "serve_tokens_per_second": s, "fixed_tokens_per_second": f,
                    "ratio": round(s / f, 3) if s and f else None})
    return out


def soak_figures(samples, n: int) -> dict:
    base_at = max(1, n // 10)
    after = [s for s in samples if s[2] >= base_at]
    if not after:
        return {"samples": len(samples)}
    base = after[0][1]
    peak = max(s[1] for s in after)
    return {"samples": len(samples), "baseline_after_requests": base_at, "rss_baseline_mb": round(base / 2**20, 1),
            "rss_max_mb": round(peak / 2**20, 1), "rss_last_mb": round(samples[-1][1] / 2**20, 1),
            "rss_first_mb": round(samples[0][1] / 2**20, 1),
            "growth_max": round((peak - base) / base, 4), "growth_last": round((samples[-1][1] - base) / base, 4)}


# ---------------------------------------------------------------------------- the run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true",
                   help="a smoke run: gen 64, rates 4 8, 40 requests each, soak 80, 24 prompts")
    p.add_argument("--model", default=str(ROOT / "models" / "llada-12m"))
    p.add_argument("--preset", default="fast-dllm")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--gen", type=int, default=128, help="generation length (the server's --gen; max_tokens)")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32],
                   help="Poisson arrival rates, requests/s, tried in order until one breaks the server")
    p.add_argument("--n", type=int, default=80, help="requests per rate")
    p.add_argument("--pool", type=int, default=120, help="distinct prompts (the task prompts), reused in turn")
    p.add_argument("--soak", type=int, default=1000, help="requests of the soak")
    p.add_argument("--soak-rate", type=float, default=6.0, help="requests/s of the soak")
    p.add_argument("--break-factor", type=float, default=10.0,
                   help="a rate breaks a server whose p99 latency exceeds this times its p99 at the first rate")
    p.add_argument("--p99-bound", type=float, default=2.0, help="the headline bound of throughput at equal p99")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a client waits for its response")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve"))
    args = p.parse_args(argv)
    if args.small:
        args.gen, args.rates, args.n, args.soak, args.soak_rate, args.pool = 64, [4.0, 8.0], 40, 80, 8.0, 24
    for name in ("max_batch", "gen", "n", "pool", "soak"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()

    import jax
    import psutil

    import dlm_jax
    from benchmarks._hardware import machine
    from dlm_jax.executors._compile import enable_default_cache

    enable_default_cache()  # the directory the server's CLI uses too (DLM_JAX_CACHE_DIR or ~/.cache)
    model = dlm_jax.load(args.model, executor="jax")
    decoder = model.decoder
    name = os.path.basename(os.path.normpath(args.model))
    cfg = dlm_jax.preset(args.preset, gen_len=args.gen, block_len=args.block)
    pool = _prompts(model, args.pool)
    phases = workload(args.rates, args.n, args.soak, args.soak_rate, args.pool)
    pool_of = {r["i"]: r["prompt"] for ph in phases for r in ph["reqs"]}
    max_len = model.config.max_seq_len
    bad = {k: bad_body(k, name, max_len) for k in BAD_CLASSES}

    # References: each prompt alone.
    _log(f"references: {args.pool} prompts decoded alone (gen {args.gen}, {args.preset})")
    eos = set(model.config.eos_ids)
    refs = {}
    t = time.perf_counter()
    for j, ids in enumerate(pool):
        toks = _trim(decoder.decode([ids], cfg).sequences[0], eos)[:args.gen]
        refs[j] = {"tokens": toks, "text": model.tokenizer.decode(toks)}
    ref_seconds = time.perf_counter() - t

    # Fixed batches, in this process, no server running.
    fixed_rows = []
    for ph in phases[:-1]:
        idx = [r["i"] for r in ph["reqs"] if r["kind"] != "bad"]
        arr = [r["arrival"] for r in ph["reqs"] if r["kind"] != "bad"]
        outs = run_fixed(decoder, cfg, [pool[pool_of[i]] for i in idx], arr, args.max_batch)
        row = fixed_summary(ph, outs, idx, refs, pool_of)
        row["broken"] = bool(fixed_rows) and broken(row, fixed_rows[0], args.break_factor)
        fixed_rows.append(row)
        print(json.dumps(row), flush=True)
        if row["broken"]:
            break

    # The server.
    cmd = [str(Path(sys.executable).parent / "dlm-jax"), "serve", "--model", args.model, "--port", "0",
           "--max-batch", str(args.max_batch), "--preset", args.preset, "--gen", str(args.gen),
           "--block", str(args.block), "--max-waiting", "256", "--executor", "jax"]
    _log("starting: " + " ".join(cmd))
    t = time.perf_counter()
    log_dir = Path(tempfile.mkdtemp(prefix="dlm-jax-serve-bench-"))
    server = Server(cmd, log_dir / "server.log")
    start_seconds = time.perf_counter() - t
    url = server.url
    _log(f"{url} ready: {server.warmup}")
    serve_rows, records, soak = [], {}, {}
    try:
        rss = psutil.Process(server.proc.pid)

        async def solo_checks() -> list[bool]:
            import httpx

            async with httpx.AsyncClient(timeout=args.timeout) as client:
                await _wait_healthy(client, url)
                same = []
                for j in range(min(4, len(pool))):
                    r = await client.post(url + "/v1/completions",
                                          json={"model": name, "prompt": pool[j], "max_tokens": args.gen})
                    c = r.json()["choices"][0]
                    same.append(c["text"] == refs[j]["text"]
                                and r.json()["usage"]["completion_tokens"] == len(refs[j]["tokens"]))
                return same

        solo = asyncio.run(solo_checks())
        _log(f"alone on the server = alone in process: {solo}")
        for ph in phases[:-1]:
            recs, _, idle = asyncio.run(run_phase(url, name, ph, pool, bad, args.gen, timeout=args.timeout))
            row = serve_summary(ph, recs, refs, pool_of)
            row["idle_after"] = idle
            row["broken"] = bool(serve_rows) and broken(row, serve_rows[0], args.break_factor)
            serve_rows.append(row)
            records[ph["label"]] = recs
            print(json.dumps(row), flush=True)
            if row["broken"]:
                break
        ph = phases[-1]
        _log(f"soak: {len(ph['reqs'])} requests at {ph['rate']:g}/s")
        recs, samples, idle = asyncio.run(run_phase(url, name, ph, pool, bad, args.gen, timeout=args.timeout,
                                                     rss=rss))
        soak = serve_summary(ph, recs, refs, pool_of)
        soak.update(idle_after=idle, rss=soak_figures(samples, len(ph["reqs"])),
                    rss_samples=[[s[0], round(s[1] / 2**20, 2), s[2]] for s in samples])
        records["soak"] = recs
        print(json.dumps({k: v for k, v in soak.items() if k != "rss_samples"}), flush=True)

        async def scrape() -> str:
            import httpx

            async with httpx.AsyncClient(timeout=30) as client:
                return (await client.get(url + "/metrics")).text

        metrics = asyncio.run(scrape())
    finally:
        rc = server.stop()
    tracebacks = server.tracebacks()
    shutil.rmtree(log_dir, ignore_errors=True)

    def metric(prefix: str) -> dict:
        found = {}
        for line in metrics.splitlines():
            if line.startswith(prefix) and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                found[key[len(prefix):] or "total"] = float(value)
        return found

    broke = {r["phase"] for r in serve_rows if r["broken"]}
    all_recs = [{**r, "phase": label} for label, recs in records.items() for r in recs]
    bad_recs = [r for r in all_recs if r["kind"] == "bad"]
    per_class = {}
    for k in BAD_CLASSES:
        rs = [r for r in bad_recs if r["bad"] == k]
        per_class[k] = {"sent": len(rs), "statuses": sorted({r["status"] for r in rs}, key=str),
                        "all_4xx": bool(rs) and all(r["status"] and 400 <= r["status"] < 500 for r in rs),
                        "ms_max": round(1000 * max((r["seconds"] for r in rs), default=0.0), 1),
                        "ms_max_sustained": round(1000 * max((r["seconds"] for r in rs if r["phase"] not in broke),
                                                             default=0.0), 1),
                        "ms_p50": round(1000 * float(np.median([r["seconds"] for r in rs])), 1) if rs else None,
                        "message": next((r["message"] for r in rs if r.get("message")), None)}
    rows_all = serve_rows + [soak]
    totals = {k: sum(r.get(k, 0) for r in rows_all) for k in ("well_formed", "completed", "wrong", "lost",
                                                              "server_errors", "refused_429", "disconnected", "bad",
                                                              "bad_4xx")}
    report = {
        "benchmark": "benchmarks/serve.py",
        "command": " ".join([Path(sys.executable).name, "benchmarks/serve.py"] + list(sys.argv[1:] if argv is None
                                                                                          else argv)),
        "server_command": " ".join(["dlm-jax"] + cmd[1:]).replace(str(ROOT) + "/", ""),
        "model": name, "preset": args.preset, "gen_len": args.gen, "block_len": args.block,
        "max_batch": args.max_batch, "small": args.small, "requests_per_rate": args.n, "pool": args.pool,
        "machine": {**machine(), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "reference_seconds": round(ref_seconds, 2),
        "server_start_seconds": round(start_seconds, 2), "warmup": server.warmup,
        "solo_on_server_equals_in_process": solo,
        "fixed": fixed_rows, "serve": serve_rows, "soak": soak,
        "throughput_at_equal_p99": ratios(serve_rows, fixed_rows, sorted(set(BOUNDS) | {args.p99_bound})),
        "p99_bound": args.p99_bound,
        "bad_input": per_class, "totals": totals,
        "server_metrics": {"requests": metric("dlm_jax_requests_total"), "refusals": metric("dlm_jax_refusals_total")},
        "server_exit_code": rc, "server_log_tracebacks": tracebacks,
    }
    head = next(r for r in report["throughput_at_equal_p99"] if r["p99_bound"] == args.p99_bound)
    report["targets"] = {
        "wrong_lost_5xx": [totals["wrong"], totals["lost"], totals["server_errors"]],
        "throughput_ratio_at_p99_bound": head["ratio"], "throughput_ratio_target": 1.3,
        "rss_growth_after_warmup": soak.get("rss", {}).get("growth_max"), "rss_growth_target": 0.05,
        "bad_input_all_4xx": all(v["all_4xx"] for v in per_class.values()),
        "bad_input_ms_max": max((v["ms_max"] for v in per_class.values()), default=None), "bad_input_ms_target": 100,
        "bad_input_ms_max_sustained": max((v["ms_max_sustained"] for v in per_class.values()), default=None),
    }
    atomic_write_json(out.with_suffix(".json"), report, indent=1)
    atomic_write(out.with_suffix(".md"), markdown(report))
    atomic_write(out.with_suffix(".png"), plot(report))
    print(json.dumps(report["targets"]), flush=True)
    return 0


# ---------------------------------------------------------------------------- writing it up


def markdown(rep: dict) -> str:
    m = rep["machine"]
    t = rep["targets"]
    lines = [f"# `dlm-jax serve` under open-loop load ({rep['model']}, {rep['preset']}, gen {rep['gen_len']}, "
             f"block {rep['block_len']}, max batch {rep['max_batch']})", "",
             f"Written by `benchmarks/serve.py` ({rep['command']}); {m['cpu']}, {m['cores']} cores, Python "
             f"{m['python']}, JAX {m['jax']}; load average (1 min) {m['load_average_before'][0]} before the run, "
             f"{m['load_average_after'][0]} after. Server: "
             f"`{rep['server_command']}`, warm-up {rep['warmup']['programs']} programs in "
             f"{rep['warmup']['seconds']} s. Fixed batches ran in the benchmark's process with no server running; "
             "their seconds exclude compile waits.", "",
             "## Targets", "",
             "| target | measured | goal |", "|---|---|---|",
             f"| wrong / lost / 5xx over every well-formed request | {' / '.join(map(str, t['wrong_lost_5xx']))} "
             f"(of {rep['totals']['well_formed']}) | 0 / 0 / 0 |",
             f"| sustained tokens/s, serve over fixed batches, p99 <= {rep['p99_bound']:g} s | "
             f"{t['throughput_ratio_at_p99_bound']} | >= 1.3 |",
             f"| resident memory growth over the soak after warm-up | "
             f"{_percent(t['rss_growth_after_warmup'])} | < 5% |",
             f"| bad input: every class a 4xx; slowest answer at the rates sustained (at every rate) | "
             f"{t['bad_input_all_4xx']}; {t['bad_input_ms_max_sustained']} ms ({t['bad_input_ms_max']} ms) "
             "| all; < 100 ms |", "",
             f"Alone on the idle server = alone in process (first prompts): {rep['solo_on_server_equals_in_process']}. "
             f"Server exit code after SIGTERM: {rep['server_exit_code']}; tracebacks in its log: "
             f"{rep['server_log_tracebacks']}.", "",
             "## Per rate (Poisson arrivals; 10% disconnect early, 5% malformed)", "",
             "| rate /s | server | tokens/s | requests/s | achieved / offered | latency p50 / p99 (s) | "
             "first chunk p50 / p99 (s) | wrong / lost / 5xx / 429 | broke |", "|---|---|---|---|---|---|---|---|---|"]
    fixed = {r["phase"]: r for r in rep["fixed"]}
    serve = {r["phase"]: r for r in rep["serve"]}
    for label in dict.fromkeys(list(fixed) + list(serve)):
        for r in (fixed.get(label), serve.get(label)):
            if r is None:
                continue
            faults = (f"{r['wrong']} / {r['lost']} / {r['server_errors']} / {r['refused_429']}"
                      if r["server"] == "serve" else f"({r['differs_from_solo']} differ from solo)")
            lines.append(f"| {r['offered_rps']:g} | {r['server']} | {r.get('tokens_per_second')} | "
                         f"{r.get('requests_per_second')} | {r.get('achieved_over_offered')} | "
                         f"{r.get('latency_p50')} / {r.get('latency_p99')} | "
                         f"{r.get('ttfc_p50')} / {r.get('ttfc_p99')} | "
                         f"{faults} | {'yes' if r.get('broken') else ''} |")
    lines += ["", "Sustained throughput (the highest tokens/s among the rates whose p99 latency is within the bound "
              "and whose completions kept up, achieved / offered >= 0.8):",
              "", "| p99 bound (s) | serve tokens/s | fixed tokens/s | serve / fixed |", "|---|---|---|---|"]
    for r in rep["throughput_at_equal_p99"]:
        lines.append(f"| {r['p99_bound']:g} | {r['serve_tokens_per_second']} | {r['fixed_tokens_per_second']} | "
                     f"{r['ratio']} |")
    tot = rep["totals"]
    seen_gone = rep["server_metrics"]["requests"].get('{endpoint="/v1/completions",outcome="disconnected"}', 0)
    lines += ["", "## Fault mix (every phase and the soak)", "",
              f"Well-formed requests {tot['well_formed']}: completed identical to their solo decode "
              f"{tot['completed']}, wrong {tot['wrong']}, lost {tot['lost']}, 5xx {tot['server_errors']}, "
              f"refused 429 {tot['refused_429']}. Disconnected mid-stream: {tot['disconnected']} (the server counted "
              f"{seen_gone:g}"
              " as disconnected). Malformed: "
              f"{tot['bad']}, {tot['bad_4xx']} answered 4xx.", "",
              "| bad input | sent | status | ms p50 / max at the rates sustained / max | error message |",
              "|---|---|---|---|---|"]
    for k, v in rep["bad_input"].items():
        msg = (v["message"] or "").replace("|", "\\|")
        lines.append(f"| {k} | {v['sent']} | {', '.join(map(str, v['statuses']))} | {v['ms_p50']} / "
                     f"{v['ms_max_sustained']} / {v['ms_max']} | "
                     f"{msg[:100]} |")
    s = rep["soak"]
    rss = s.get("rss", {})
    lines += ["", f"## Soak ({s.get('requests')} requests at {s.get('offered_rps')}/s)", "",
              f"Tokens/s {s.get('tokens_per_second')}, latency p50 / p99 {s.get('latency_p50')} / "
              f"{s.get('latency_p99')} s; wrong / lost / 5xx {s.get('wrong')} / {s.get('lost')} / "
              f"{s.get('server_errors')}.", "",
              f"| RSS MB: at start | after the first {rss.get('baseline_after_requests')} requests | max after | "
              "last | growth (max) | growth (last) |", "|---|---|---|---|---|---|",
              f"| {rss.get('rss_first_mb')} | {rss.get('rss_baseline_mb')} | {rss.get('rss_max_mb')} | "
              f"{rss.get('rss_last_mb')} | {_percent(rss.get('growth_max'))} | "
              f"{_percent(rss.get('growth_last'))} |", ""]
    return "\n".join(lines)


def _percent(x) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def plot(rep: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._plots import png_bytes

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, marker in (("fixed", "o"), ("serve", "s")):
        pts = [r for r in rep[key] if r.get("latency_p99") is not None]
        line = ax.plot([r["tokens_per_second"] for r in pts], [r["latency_p99"] for r in pts], marker=marker,
                       label=f"{key} p99")[0]
        ax.plot([r["tokens_per_second"] for r in pts], [r["latency_p50"] for r in pts], marker=marker, ls="--",
                color=line.get_color(), alpha=0.6, label=f"{key} p50")
    ax.axhline(rep["p99_bound"], color="grey", lw=0.8, ls=":", label=f"p99 bound {rep['p99_bound']:g} s")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (completion tokens/s)")
    ax.set_ylabel("latency (s)")
    ax.set_title(f"{rep['model']}: Poisson arrivals, max batch {rep['max_batch']}")
    ax.legend(fontsize=8)
    samples = rep["soak"].get("rss_samples") or []
    if samples:
        bx.plot([s[0] for s in samples], [s[1] for s in samples])
        base = rep["soak"]["rss"].get("baseline_after_requests")
        at = next((s[0] for s in samples if s[2] >= (base or 0)), None)
        if at is not None:
            bx.axvline(at, color="grey", lw=0.8, ls=":", label=f"after {base} requests")
            bx.legend(fontsize=8)
    bx.set_xlabel("seconds into the soak")
    bx.set_ylabel("server RSS (MB)")
    bx.set_title(f"soak: {rep['soak'].get('requests')} requests at {rep['soak'].get('offered_rps')}/s")
    fig.tight_layout()
    return png_bytes(fig)


if __name__ == "__main__":
    raise SystemExit(main())
