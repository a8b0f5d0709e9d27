"""What a step costs when its proposals come from the rows' logits: on the host, and beside
the step.

    .venv/bin/python benchmarks/logits_host.py [--vocab 126464] [--rows 32] [--out benchmarks/results/logits_host]

Greedy decoding takes the step's own argmax and probabilities (four [B, R] arrays). Sampling
(temperature > 0), OpenAI's penalties and logit bias, and recorded log-probabilities instead
bring back the step's R x V logits and work on them on the host in float64
(`Proposer.propose`, `DecodeState.record_logprobs`). This times each of those host paths on
random logits of LLaDA-8B's vocabulary (126,464) for one request's 32 predicted rows, the
median of `--repeats` runs, with the logits' bytes per step; no model runs.

Each case also runs with the logits kept where a JAX step leaves them (`Proposer.logits_on`
"device": `dlm_jax.executors._logits.DeviceLogits` on JAX's default backend, in float32),
timed to its answers on the host (the first, compiling, run not counted), with the bytes read
back.

Then an engine's call of `--requests` sampling requests, each its own batch row and its own
options: their proposals answered one request at a time (a device call and a sync each) and
all at once (`DeviceLogits.answer`: one program over the rows, what the engine runs).

Last, ISD's acceptance of one request's drafts at stride `--stride` (a verify step's 2N-1
rows, N-1 drafts proposed from the previous step's rows) in its modes that read the logits:
on the host (`Acceptance.judge` over the rows read back, and the IAR's terms), and beside the
step (a `JudgeAsk` answered, then `Acceptance.judge_answered`).
Prints JSON and writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlm_jax._integrity import atomic_write  # noqa: E402
from dlm_jax.executors._logits import DeviceLogits  # noqa: E402
from dlm_jax.runtime.kvcache import Transfers  # noqa: E402
from dlm_jax.runtime.proposer import Proposer, sampling_probs  # noqa: E402
from dlm_jax.runtime.state import DecodeState, TokenState  # noqa: E402
from dlm_jax.runtime.step import JudgeAsk, ProposeAsk, StepOutputs, answer  # noqa: E402
from dlm_jax.techniques.isd.strided import Acceptance  # noqa: E402

from _hardware import machine  # noqa: E402

PROMPT, GEN = 128, 256

# (case, proposer, slots whose log-probabilities are recorded (0: none), alternatives per token)
CASES = [
    ("greedy (the step's argmax)", Proposer(), 0, 0),
    ("sampling, temperature 0.7", Proposer(temperature=0.7), 0, 0),
    ("sampling, top-k 40", Proposer(temperature=0.7, top_k=40), 0, 0),
    ("sampling, top-p 0.9", Proposer(temperature=0.7, top_p=0.9), 0, 0),
    ("presence + frequency penalties", Proposer(presence_penalty=0.5, frequency_penalty=0.5), 0, 0),
    ("logit_bias, 3 tokens", Proposer(logit_bias=((5, 2.0), (7, -100.0), (9, 1.0))), 0, 0),
    ("logprobs, 1 slot decided", Proposer(logprobs=0), 1, 0),
    ("logprobs, 4 slots decided", Proposer(logprobs=5), 4, 5),
    ("logprobs, 32 slots decided", Proposer(logprobs=5), 32, 5),
    ("logprobs, 32 slots decided, top 20", Proposer(logprobs=20), 32, 20),
]


# ISD's modes that read more of the logits than the anchors' tokens: (case, rule, sampler, IAR)
JUDGES = [
    ("ISD relaxed (T = 0, relax 0.5), IAR", Acceptance(relax=0.5), Proposer(), True),
    ("ISD p / q over sampled drafts (T = 0.7)", Acceptance(proposal="sample"), Proposer(temperature=0.7), False),
    ("ISD softmax_q, top-p 0.9 (T = 0.7)", Acceptance(verify="softmax_q"), Proposer(temperature=0.7, top_p=0.9),
     False),
    ("ISD p / q, penalties + bias (T = 0.7)", Acceptance(proposal="sample"),
     Proposer(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((4, 2.5), (7, -1.0))), False),
]


def _state(vocab: int, top: int) -> DecodeState:
    state = DecodeState.create([[1] * PROMPT], gen_len=GEN, batch=1, mask_id=vocab - 1, vocab_size=vocab)
    half = slice(PROMPT + 64, PROMPT + 128)  # some committed text (the penalties count it)
    state.tokens[0, half] = np.random.default_rng(1).integers(0, vocab - 1, 64)
    state.status[0, half] = TokenState.STABLE
    state.track_logprobs(top)
    return state


def measure(vocab: int, rows: int, repeats: int) -> dict[str, Any]:
    logits = np.random.default_rng(0).normal(0, 3, (1, rows, vocab)).astype(np.float32)
    logits[..., vocab - 1] = -np.inf  # the mask token, as the step returns it
    plain = StepOutputs(top_token=logits.argmax(-1).astype(np.int32), top_prob=np.full((1, rows), 0.5, np.float32),
                        second_prob=np.full((1, rows), 0.1, np.float32), entropy=np.ones((1, rows), np.float32))
    full = StepOutputs(**{**plain.__dict__, "logits": logits})
    counted = Transfers()  # what the device path reads back, as a decode's steps count it
    kept = DeviceLogits(jax.device_put(logits), transfers=counted)
    slots = np.arange(PROMPT, PROMPT + rows)
    cases = []
    for name, proposer, decided, top in CASES:
        row = {"case": name}
        for where, lg in (("host", logits), ("device", kept)):
            state = _state(vocab, top)
            out = StepOutputs(**{**plain.__dict__, "logits": lg}) if proposer.needs_logits else plain
            times, back = [], 0
            for i in range(repeats + (where == "device")):
                counted.add(0, 0)
                t0 = time.perf_counter()
                proposal = proposer.propose(out, np.ones((1, rows), bool), state)
                if decided:
                    state.tokens[0, slots] = proposal.tokens[0]
                    status = np.full(rows, TokenState.MASK, np.int8)
                    status[:decided] = TokenState.STABLE
                    state.status[0, slots] = status
                    state.record_logprobs(slots, np.ones((1, rows), bool), lg)
                    state.status[0, slots] = TokenState.MASK
                if where == "host" or i:  # (the device's first run compiles)
                    times.append(time.perf_counter() - t0)
            if where == "host":
                back = int(logits.nbytes) if proposer.needs_logits else 0
            else:  # the answers: [5, 1, R] int32 a proposal, [m, 1 + 2k] a record of m slots
                back = counted.d2h[-1]
            row[f"{where}_ms"] = round(1000 * statistics.median(times), 2)
            row[f"{where}_bytes"] = back
        cases.append(row)
    return {"vocab": vocab, "rows": rows, "repeats": repeats, "machine": machine(), "backend": jax.default_backend(),
            "cases": cases}


def measure_call(vocab: int, rows: int, requests: int, repeats: int) -> dict[str, Any]:
    """An engine call's proposals: `requests` rows of one step's logits, each a request with its
    own sampling options, answered per request and together (ms to the answers on the host)."""
    logits = np.random.default_rng(2).normal(0, 3, (requests, rows, vocab)).astype(np.float32)
    counted = Transfers()
    kept = DeviceLogits(jax.device_put(logits), transfers=counted)
    options = [dict(temperature=0.6 + 0.1 * (i % 5), top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[(i // 2) % 2])
               for i in range(requests)]
    asks = [ProposeAsk(kept.rows([i]), np.ones(1, bool), np.array([i], np.uint32), **o) for i, o in enumerate(options)]
    row: dict[str, Any] = {"requests": requests}
    for how, run in (("per_request", lambda: [DeviceLogits.answer([a]) for a in asks]),
                     ("together", lambda: DeviceLogits.answer(asks))):
        times = []
        for i in range(repeats + 1):
            counted.add(0, 0)
            t0 = time.perf_counter()
            run()
            if i:  # (the first run compiles)
                times.append(time.perf_counter() - t0)
        row[f"{how}_ms"] = round(1000 * statistics.median(times), 2)
        row[f"{how}_calls"] = len(asks) if how == "per_request" else 1
        row[f"{how}_bytes"] = counted.d2h[-1]
    row["per_request_over_together"] = round(row["per_request_ms"] / row["together_ms"], 2)
    return row


def measure_judge(vocab: int, stride: int, repeats: int) -> list[dict[str, Any]]:
    """ISD's acceptance of one request's N-1 drafts, on the host and beside the step (ms to its
    decision on the host; bytes read back: the verify step's rows, or the answers)."""
    k = stride - 1
    rng = np.random.default_rng(4)
    p_z = rng.normal(0, 3, (1, 2 * stride - 1, vocab)).astype(np.float32)
    q_z = rng.normal(0, 3, (1, 2 * stride - 1, vocab)).astype(np.float32)
    counted = Transfers()
    p_kept = DeviceLogits(jax.device_put(p_z), transfers=counted)
    q_kept = DeviceLogits(jax.device_put(q_z))
    drafts, anchors = p_z[0, :k].argmax(-1), p_z[0, :k + 1].argmax(-1)  # (greedy anchors accept at T = 0)
    state = _state(vocab, 0)  # (some committed text: the penalties count it)
    ids = np.repeat(state.committed_ids(), k, axis=0)
    rows = []
    for name, rule, sampler, iar in JUDGES:
        t = sampler.temperature

        def host(seed: int) -> None:
            p_logits = np.asarray(p_z[:, :k + 1])  # (the verify step's rows, read back)
            q_logits = q_z[:, stride:stride + k]  # (kept from the previous step's, adjusted then)
            if sampler.adjusts:
                p_logits, q_logits = sampler.adjusted(p_logits, state), sampler.adjusted(q_logits, state)
            p_logits, q_logits = p_logits[0], q_logits[0]
            rule.judge(drafts, anchors, sampler, np.random.default_rng(seed), p_logits, q_logits)
            if iar:
                idx = np.arange(k)
                sampling_probs(p_logits[:k], 1.0)[idx, drafts], sampling_probs(q_logits, 1.0)[idx, drafts]

        def device(seed: int) -> None:
            ask = JudgeAsk(p_kept, b=np.zeros(k, np.int64), i=np.arange(k), tokens=drafts.astype(np.int32),
                           anchors=anchors[:k].astype(np.int32), seeds=np.full(k, seed, np.uint32),
                           use_q=np.full(k, not rule.one_hot), temperature=np.full(k, t, np.float32),
                           top_k=np.zeros(k, np.int32), top_p=np.full(k, sampler.top_p, np.float32), q=q_kept,
                           qb=np.zeros(k, np.int64), qi=stride + np.arange(k),
                           **(dict(count_ids=ids, q_count_ids=ids, presence=sampler.presence_penalty,
                                   frequency=sampler.frequency_penalty, bias=sampler.logit_bias)
                              if sampler.adjusts else {}))
            rule.judge_answered(drafts, anchors, sampler, np.random.default_rng(seed), answer([ask])[0])

        row: dict[str, Any] = {"case": name}
        for where, run in (("host", host), ("device", device)):
            times = []
            for i in range(repeats + (where == "device")):
                counted.add(0, 0)
                t0 = time.perf_counter()
                run(i)
                if where == "host" or i:  # (the device's first run compiles)
                    times.append(time.perf_counter() - t0)
            row[f"{where}_ms"] = round(1000 * statistics.median(times), 2)
            row[f"{where}_bytes"] = p_z.nbytes if where == "host" else counted.d2h[-1]  # (all the step's rows)
        rows.append(row)
    return rows


def markdown(rep: dict[str, Any]) -> str:
    lines = [f"# Host cost of proposals from logits (`benchmarks/logits_host.py`)", "",
             f"One request, {rep['rows']} predicted rows, vocabulary {rep['vocab']:,}; random float32 logits; "
             f"median of {rep['repeats']} runs on {rep['machine'].get('cpu', 'this CPU')} "
             f"({rep['machine'].get('cores', '?')} cores). No model runs: this is the proposer's share of a "
             "step only. The GPU steps it would sit between took 7.6-10.5 ms at LLaDA-8B shape on one H200 "
             "(`gpu.md`), on another machine's CPU.", "",
             f"*host*: the rows' logits read back and worked on in float64 NumPy (`logits_on=\"host\"`). "
             f"*device*: the same rules as small programs beside the logits (`logits_on=\"device\"`), here on "
             f"JAX's {rep['backend']} backend, timed to their answers on the host.", "",
             "| case | host ms | device ms | host / device | read back, host | read back, device |",
             "|---|---:|---:|---:|---:|---:|"]

    def size(n: int) -> str:
        return "-" if not n else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 \
            else f"{n} B"

    for c in rep["cases"]:
        ratio = f"{c['host_ms'] / c['device_ms']:.1f}" if c["device_ms"] > 0 else "-"
        lines.append(f"| {c['case']} | {c['host_ms']} | {c['device_ms']} | {ratio} | {size(c['host_bytes'])} "
                     f"| {size(c['device_bytes'])} |")
    call = rep.get("call")
    if call:
        lines += ["", f"## An engine call of {call['requests']} sampling requests, on the device", "",
                  "Each request one batch row with its own temperature, top-k and top-p; their proposals "
                  "answered one request at a time, then all in one program (`DeviceLogits.answer`, what "
                  "the engine runs).", "",
                  "| answered | device calls | ms | read back |", "|---|---:|---:|---:|",
                  f"| per request | {call['per_request_calls']} | {call['per_request_ms']} "
                  f"| {size(call['per_request_bytes'])} |",
                  f"| together | {call['together_calls']} | {call['together_ms']} | {size(call['together_bytes'])} |",
                  "", f"Per request / together: {call['per_request_over_together']}x."]
    if rep.get("judge"):
        lines += ["", f"## ISD's acceptance of {rep['stride'] - 1} drafts (stride {rep['stride']})", "",
                  "One request's verify step: on the host, its rows read back and the anchors' judged in float64 "
                  "(`Acceptance.judge`; the drafts' q rows kept from the step before); beside the step, a "
                  "`JudgeAsk` answered (`_logits._judge`) and `Acceptance.judge_answered`.", "",
                  "| case | host ms | device ms | host / device | read back, host | read back, device |",
                  "|---|---:|---:|---:|---:|---:|"]
        for c in rep["judge"]:
            ratio = f"{c['host_ms'] / c['device_ms']:.1f}" if c["device_ms"] > 0 else "-"
            lines.append(f"| {c['case']} | {c['host_ms']} | {c['device_ms']} | {ratio} | {size(c['host_bytes'])} "
                         f"| {size(c['device_bytes'])} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=126464)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8, help="requests in the engine call case (0: skip it)")
    ap.add_argument("--stride", type=int, default=4, help="ISD's stride in the acceptance cases (0: skip them)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "logits_host")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rep = measure(args.vocab, args.rows, args.repeats)
    if args.requests:
        rep["call"] = measure_call(args.vocab, args.rows, args.requests, args.repeats)
    if args.stride > 1:
        rep["stride"], rep["judge"] = args.stride, measure_judge(args.vocab, args.stride, args.repeats)
    print(json.dumps({"cases": rep["cases"], "call": rep.get("call"), "judge": rep.get("judge")}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out.with_suffix(".json"), json.dumps(rep, indent=1) + "\n")
    atomic_write(args.out.with_suffix(".md"), markdown(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
