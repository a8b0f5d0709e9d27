"""lm-evaluation-harness's model "dlm-jax" (`dlm_jax.frontends.lmeval`): the generated local tasks score
exactly as `dlm-jax eval` does, log-likelihoods are exact (causal) or LLaDA's Monte Carlo
estimate (masked diffusion, checked against its expectation by enumeration), and user mistakes
end in one `error:` line. Datasets load from local JSON files, offline, cached under tmp."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")

import dlm_jax  # noqa: E402
from dlm_jax._errors import ConfigError  # noqa: E402
from dlm_jax.frontends.cli import main as cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLADA = ROOT / "models" / "llada-tiny"
AR = ROOT / "models" / "ar-tiny"
N = 8  # held-out prompts per task (the default run stays short)


@pytest.fixture(scope="module")
def hf_sandbox(tmp_path_factory):
    """HF datasets offline, caching under a tmp dir (never ~/.cache), also where `datasets`
    was imported before (its config reads the environment once)."""
    home = tmp_path_factory.mktemp("hf")
    env = {"HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    import datasets.config as dc

    for name, value in (("HF_CACHE_HOME", str(home)), ("HF_DATASETS_CACHE", home / "datasets"),
                        ("HF_MODULES_CACHE", home / "modules"), ("HF_HUB_OFFLINE", True),
                        ("HF_DATASETS_OFFLINE", True),
                        ("DOWNLOADED_DATASETS_PATH", home / "datasets" / "downloads"),
                        ("EXTRACTED_DATASETS_PATH", home / "datasets" / "downloads" / "extracted")):
        if hasattr(dc, name):
            mp.setattr(dc, name, value)
    yield env
    mp.undo()


@pytest.fixture(scope="module")
def lmeval():
    import dlm_jax.frontends.lmeval

    return dlm_jax.frontends.lmeval


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, lmeval):
    d = tmp_path_factory.mktemp("tasks")
    lmeval.write_tasks(d, n=N)
    return d


@pytest.fixture(scope="module")
def llada(lmeval):
    return lmeval.DlmJaxLM(pretrained=str(LLADA), executor="jax", gen_len=64)


@pytest.fixture(scope="module")
def ar(lmeval):
    return lmeval.DlmJaxLM(pretrained=str(AR), executor="jax")


def _req(*args):
    return types.SimpleNamespace(args=args)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _task_manager(task_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)  # no index of lm-eval's 200+ tasks


# ---------------------------------------------------------------------------------------------
# Tasks and scores


def test_written_tasks_hold_the_heldout_split_and_distractors(task_dir, lmeval):
    from dlm_jax.training.data import TASKS, make_split

    for name in TASKS:
        rows = [json.loads(line) for line in (task_dir / f"dlmjax_{name}.jsonl").read_text().splitlines()]
        examples = make_split(TASKS[name], N, split="heldout", seed=0)
        assert [(r["prompt"], r["answer"]) for r in rows] == [(e.prompt, e.answer) for e in examples]
        for r in rows:
            assert len(r["choices"]) == len(set(r["choices"])) == 4 and r["choices"][r["gold"]] == r["answer"]
            # the near misses score wrong by the task's own scorer
            ex = next(e for e in examples if e.prompt == r["prompt"])
            assert [TASKS[name].score(c, ex) for c in r["choices"]].count(True) == 1
        for yaml in (f"dlmjax_{name}.yaml", f"dlmjax_{name}_mc.yaml"):
            text = (task_dir / yaml).read_text()
            assert str(task_dir / f"dlmjax_{name}.jsonl") in text and "dataset_path: json" in text
    again = lmeval.multiple_choice("addition", "564+894=", "1458")
    assert again == lmeval.multiple_choice("addition", "564+894=", "1458")  # deterministic


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_simple_evaluate_scores_exactly_as_dlm_jax_eval(hf_sandbox, task_dir, lmeval):
    """The generative task's exact_match is `dlm-jax eval`'s accuracy on the same prompts with
    the same decoder, completion for completion; the multiple-choice variant of a task the
    model solves scores well above chance."""
    import lm_eval

    from dlm_jax.training.evaluate import evaluate

    results = lm_eval.simple_evaluate(
        model="dlm-jax", model_args=f"pretrained={LLADA},executor=jax,preset=fast-dllm,gen_len=64,mc_num=64",
        tasks=["dlmjax_sorting", "dlmjax_addition_mc"], task_manager=_task_manager(task_dir), log_samples=True)
    handle = dlm_jax.load(LLADA, executor="jax")
    report = evaluate(handle, "sorting", dlm_jax.preset("fast-dllm", gen_len=64), n=N, max_batch=8, progress=False,
                      keep=N)
    got = results["results"]["dlmjax_sorting"]["exact_match,none"]
    assert got == report["accuracy"]
    samples = sorted(results["samples"]["dlmjax_sorting"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == [s["completion"] for s in report["samples"]]
    assert results["results"]["dlmjax_addition_mc"]["acc,none"] >= 0.75  # chance: 0.25


def test_lm_evals_chat_template_is_what_the_chat_arg_builds(llada, lmeval):
    """--apply_chat_template: lm-eval renders a request's chat through `apply_chat_template`;
    a one-turn chat is exactly the prompt the `chat` arg wraps, its log-likelihood pairs and
    its completion the same, and a few-shot chat encodes as the tokenizer's `apply_chat`."""
    templated = lmeval.DlmJaxLM(pretrained=str(LLADA), executor="jax", gen_len=64)
    tok = templated.handle.tokenizer
    rendered = templated.apply_chat_template([{"role": "user", "content": "564+894="}])
    assert tok.encode(rendered) == templated.handle.encode("564+894=", chat=True)
    assert templated.encode_pair(rendered, "1458") == llada.encode_pair("564+894=", "1458")
    until = {"until": [], "max_gen_toks": 64}
    assert templated.generate_until([_req(rendered, until)], disable_tqdm=True) == \
        llada.generate_until([_req("564+894=", until)], disable_tqdm=True) == ["1458"]
    shots = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
             {"role": "user", "content": "564+894="}]
    assert tok.encode(templated.apply_chat_template(shots)) == tok.apply_chat(shots)
    with pytest.raises(ConfigError, match="chat=true and --apply_chat_template"):
        lmeval.DlmJaxLM(pretrained=str(LLADA), executor="jax", chat="true").apply_chat_template(shots)


@pytest.mark.slow
def test_simple_evaluate_with_the_chat_template_scores_as_without(hf_sandbox, task_dir, lmeval):
    """lm-eval's own chat templating (`apply_chat_template=True`) of a one-turn task gives the
    completions and choices the `chat` arg gives."""
    import lm_eval

    runs = [lm_eval.simple_evaluate(
        model="dlm-jax", model_args=f"pretrained={LLADA},executor=jax,preset=fast-dllm,gen_len=64,mc_num=32",
        tasks=["dlmjax_sorting", "dlmjax_addition_mc"], task_manager=_task_manager(task_dir), log_samples=True,
        apply_chat_template=template, limit=4) for template in (False, True)]
    plain, templated = ({t: sorted(r["samples"][t], key=lambda s: s["doc_id"]) for t in r["samples"]} for r in runs)
    assert templated["dlmjax_sorting"][0]["arguments"][0][0].endswith("<|end|><|assistant|>")  # rendered by lm-eval
    assert plain["dlmjax_sorting"][0]["arguments"][0][0] == templated["dlmjax_sorting"][0]["doc"]["prompt"]
    for task in ("dlmjax_sorting", "dlmjax_addition_mc"):
        assert [s["resps"] for s in templated[task]] == [s["resps"] for s in plain[task]]
    assert runs[1]["results"] == runs[0]["results"]


def test_generation_length_and_stop_strings(llada, lmeval):
    """max_gen_toks rounds up to whole blocks unless gen_len is fixed; a completion is cut at
    the first of its `until` strings."""
    free = lmeval.DlmJaxLM.__new__(lmeval.DlmJaxLM)
    free.decode_config, free.fixed_gen_len = llada.decode_config, False
    assert free._gen_config({"max_gen_toks": 40}).gen_len == 64
    assert free._gen_config({"max_gen_toks": 64}).gen_len == 64
    assert free._gen_config({"max_gen_toks": 65}).gen_len == 96
    assert llada._gen_config({"max_gen_toks": 256}).gen_len == 64  # gen_len=64 given
    with pytest.warns(UserWarning, match="asks for sampling"):  # greedy unless the decode config samples
        full, cut, several = llada.generate_until([
            _req("564+894=", {"until": [], "max_gen_toks": 64}),
            _req("564+894=", {"until": ["5"], "max_gen_toks": 64, "do_sample": True, "temperature": 0.7}),
            _req("564+894=", {"until": ["8", "45"], "max_gen_toks": 64}),
        ], disable_tqdm=True)
    assert full == "1458" and cut == "14" and several == "1"


def test_a_mesh_model_arg_decodes_on_the_mesh(llada, lmeval):
    """`mesh=` reaches `dlm_jax.load`: a one-device mesh here (meshes of several devices: the slow
    test below), whose executor holds a placement and answers as the plain one."""
    lm = lmeval.DlmJaxLM(pretrained=str(LLADA), executor="jax", gen_len=64, mesh="tp=1")
    assert lm.handle.executor.placement is not None
    req = [_req("564+894=", {"until": [], "max_gen_toks": 64})]
    assert lm.generate_until(req, disable_tqdm=True) == llada.generate_until(req, disable_tqdm=True) == ["1458"]


_ON_A_MESH = """
import json, os, sys, types
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
from dlm_jax.frontends.lmeval import DlmJaxLM

path, mesh, causal = sys.argv[1], sys.argv[2], sys.argv[3] == "causal"
req = lambda *args: types.SimpleNamespace(args=args)
out = {}
for name, extra in (("one", {}), ("mesh", {"mesh": mesh})):
    lm = DlmJaxLM(pretrained=path, executor="jax", gen_len=64, **extra)
    placement = lm.handle.executor.placement
    out[name] = {"devices": 1 if placement is None else placement.mesh.devices.size,
                 "until": lm.generate_until([req("564+894=", {"until": [], "max_gen_toks": 64}),
                                             req("sort: 9 3 27", {"until": [], "max_gen_toks": 64})], disable_tqdm=True),
                 "ll": lm.loglikelihood([req("564+894=", "1458"), req("564+894=", "1400"), req("12+9=", "21")],
                                        disable_tqdm=True),
                 "rolling": lm.loglikelihood_rolling([req("def f(x): x+12")], disable_tqdm=True) if causal else []}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, kind", [(LLADA, "tp=2;dp=2", "masked"), (AR, "tp=2", "causal")])
def test_a_mesh_of_several_devices_answers_and_scores_as_one(model, mesh, kind):
    """lm-eval's `mesh=` on host devices (a process of its own): generate_until answers as one
    device, and the log-likelihoods (the masked diffusion's Monte Carlo estimate, seeded, or the
    exact autoregressive sum) equal one device's up to the order of the sums split over tp."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-c", _ON_A_MESH, str(model), mesh, kind], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    one, on_mesh = got["one"], got["mesh"]
    assert (one["devices"], on_mesh["devices"]) == (1, dlm_jax.MeshShape.parse(mesh).size)
    assert on_mesh["until"] == one["until"] and any(one["until"])
    for (lp, greedy), (lp_one, greedy_one) in zip(on_mesh["ll"], one["ll"]):
        assert greedy == greedy_one and lp == pytest.approx(lp_one, rel=1e-4, abs=1e-4)
    assert on_mesh["rolling"] == pytest.approx(one["rolling"], rel=1e-4, abs=1e-4) and len(one["rolling"]) == (
        kind == "causal")


# ---------------------------------------------------------------------------------------------
# Log-likelihoods


def test_causal_loglikelihood_is_the_exact_autoregressive_sum(ar):
    """ar-tiny: log p(continuation | context) equals a per-token sum of log-softmax over the
    model's own unpadded forward, in batches and alone; is_greedy is every token the argmax;
    a document's rolling log-likelihood is the sum over its tokens from BOS on."""
    import jax.numpy as jnp

    # ar-tiny is a weak model: its greedy answer to 564+894= is 1400 (`dlm-jax eval`'s samples).
    # Equal lengths: the reference below is one unpadded forward of every sequence.
    pairs = [("564+894=", "1400"), ("564+894=", "1458"), ("999+999=", "1998"), ("500+500=", "1000")]
    text = "def f(x): x+12\n"
    got = ar.loglikelihood([_req(*p) for p in pairs], disable_tqdm=True)
    rolling = ar.loglikelihood_rolling([_req(text)], disable_tqdm=True)[0]
    seqs = [[*ar.handle.encode(ctx, chat=True), *ar.handle.tokenizer.encode(cont)] for ctx, cont in pairs]
    seqs.append([ar.handle.config.bos_token_id, *ar.handle.tokenizer.encode(text)])
    assert len({len(q) for q in seqs}) == 1
    logp = _log_softmax(np.asarray(ar.handle.model(jnp.asarray(seqs)).logits))
    for r, ((ctx, cont), (lp, greedy)) in enumerate(zip(pairs, got)):
        full = np.asarray(seqs[r])
        rows = np.arange(len(full) - len(ar.handle.tokenizer.encode(cont)) - 1, len(full) - 1)
        want = logp[r, rows, full[rows + 1]].sum()  # row i predicts token i + 1 (logit shift)
        assert lp == pytest.approx(want, abs=1e-4)
        assert greedy == bool((logp[r, rows].argmax(-1) == full[rows + 1]).all())
    assert got[0][1] and not got[1][1]
    assert ar.handle.generate("564+894=", dlm_jax.preset("ar", gen_len=8)).texts == ["1400"]
    alone = ar.loglikelihood([_req(*pairs[2])], disable_tqdm=True)[0]
    assert alone[0] == pytest.approx(got[2][0], abs=1e-5) and alone[1] == got[2][1]
    doc = np.asarray(seqs[-1])
    assert rolling == pytest.approx(logp[-1, np.arange(len(doc) - 1), doc[1:]].sum(), abs=1e-3)


@pytest.mark.slow
def test_gated_adapters_leave_the_exact_loglikelihood_of_their_base(lmeval):
    """idlm-tiny with its R-ISD adapters: the adapters act on [MASK] rows only, and a scored
    sequence has none, so every log-likelihood is the base model's. The adapters are live: with
    the gate open on every row the logits move."""
    import jax.numpy as jnp

    idlm = ROOT / "models" / "idlm-tiny"
    base = lmeval.DlmJaxLM(pretrained=str(idlm), executor="jax")
    adapted = lmeval.DlmJaxLM(pretrained=str(idlm), executor="jax", lora=str(idlm / "risd"))
    pairs = [("564+894=", "1458"), ("sort: 37 44 13", "13 37 44"), ("12+7=", "91")]
    want = base.loglikelihood([_req(*p) for p in pairs], disable_tqdm=True)
    got = adapted.loglikelihood([_req(*p) for p in pairs], disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want]
    np.testing.assert_allclose([lp for lp, _ in got], [lp for lp, _ in want], rtol=0, atol=1e-5)
    tokens = jnp.asarray([adapted.handle.encode("564+894=", chat=True)])
    open_gate = adapted.handle.model(tokens, lora_gate=jnp.ones(tokens.shape, jnp.float32)).logits
    assert float(jnp.abs(open_gate - base.handle.model(tokens).logits).max()) > 1e-2


@pytest.mark.slow
def test_mc_estimate_is_deterministic_and_unbiased_for_its_expectation(llada, lmeval):
    """LLaDA's estimator on a 3-token continuation: seeded (the same value run to run, another
    seed another value), and its mean over many rounds within 4 standard errors of its exact
    expectation, computed by enumerating every mask set with the model's plain forward."""
    import jax.numpy as jnp

    prefix, target = llada.encode_pair("93+53=", "147")  # a wrong answer: a non-trivial likelihood
    p, n, b = len(prefix), len(target), 32
    assert n == 3
    seq = np.asarray([*prefix, *target])
    mask_id = llada.handle.config.mask_token_id
    subsets = [s for m in range(1, n + 1) for s in itertools.combinations(range(n), m)]
    noisy = np.tile(seq, (len(subsets), 1))
    for r, s in enumerate(subsets):
        noisy[r, [p + j for j in s]] = mask_id
    logp = _log_softmax(np.asarray(llada.handle.model(jnp.asarray(noisy)).logits))
    loss = {m: [] for m in range(1, n + 1)}
    for r, s in enumerate(subsets):
        ce = -sum(logp[r, p + j, seq[p + j]] for j in s)
        loss[len(s)].append(ce * n / len(s))  # cross-entropy / (x / target_len)
    f = {m: np.mean(v) for m, v in loss.items()}
    expected = 0.0
    for k in range(1, n + 1):  # k uniform; x as in LLaDA's _forward_process
        x = np.round(np.linspace(k, k + (b - 1) * (n / b), b)).astype(int)
        x = ((x - 1) % n) + 1
        expected += np.mean([f[m] for m in x]) / n
    scorer = llada.scorer()
    rounds = scorer.mc_rounds(prefix, target, mc_num=64 * b, mc_batch=b, rng=lmeval.request_rng(0, prefix, target))
    se = rounds.std(ddof=1) / np.sqrt(len(rounds))
    assert abs(rounds.mean() - expected) < 4 * se + 1e-6, (rounds.mean(), expected, se)
    assert expected > 0.5  # the wrong answer is unlikely: the check is not about zeros
    once = llada.loglikelihood([_req("93+53=", "147")], disable_tqdm=True)
    assert once == llada.loglikelihood([_req("93+53=", "147")], disable_tqdm=True)
    other = lmeval.DlmJaxLM.__new__(lmeval.DlmJaxLM)
    other.__dict__.update(llada.__dict__, seed=1)
    assert other.loglikelihood([_req("93+53=", "147")], disable_tqdm=True)[0][0] != once[0][0]


def test_mc_loglikelihood_prefers_the_answer_and_checks_greedy(llada):
    """With is_check_greedy, LLaDA's greedy unmasking reproduces the right sum only; the right
    sum has the highest estimate."""
    choices = ["1458", "1468", "1457", "1448"]
    greedy = llada.__class__.__new__(llada.__class__)
    greedy.__dict__.update(llada.__dict__, is_check_greedy=True)
    got = greedy.loglikelihood([_req("564+894=", c) for c in choices], disable_tqdm=True)
    assert [g for _, g in got] == [True, False, False, False]
    assert int(np.argmax([lp for lp, _ in got])) == 0
    assert all(g is False for _, g in llada.loglikelihood([_req("564+894=", "1458")], disable_tqdm=True))


def test_loglikelihood_refusals(llada, monkeypatch):
    with pytest.raises(ConfigError, match="masked-diffusion"):
        llada.loglikelihood_rolling([_req("some text")])
    monkeypatch.setattr(llada.handle, "model", None)  # as a bundle: no Flax model
    monkeypatch.setattr(llada, "_scorer", None)
    with pytest.raises(ConfigError, match="bundle"):
        llada.loglikelihood([_req("1+1=", "2")])


# ---------------------------------------------------------------------------------------------
# Model args


def test_model_args_are_coerced_and_checked(lmeval):
    s = lmeval.model_settings(str(LLADA), threshold="0.8", block_len="16", is_check_greedy="true", mc_num=64,
                              mc_batch="32", batch_size="auto", max_batch_size=4, chat="false", device="cpu",
                              seed="3")
    assert (s.decode_config.rule.threshold, s.decode_config.scheduler.block_len) == (0.8, 16)
    assert (s.is_check_greedy, s.mc_num, s.mc_batch, s.batch_size, s.chat, s.seed) == (True, 64, 32, 4, False, 3)
    assert s.decode_config.proposer.seed == 3 and not s.fixed_gen_len
    assert lmeval.model_settings(str(LLADA), preset="llada", gen_len=64).fixed_gen_len
    with pytest.raises(ConfigError, match=r"unknown dlm-jax model arg\(s\) bogus; known: .*mc_num.*threshold"):
        lmeval.DlmJaxLM(pretrained=str(LLADA), bogus=1)
    with pytest.raises(ConfigError, match="mc_num=100 must be a multiple of mc_batch=32"):
        lmeval.DlmJaxLM(pretrained=str(LLADA), mc_num=100)
    with pytest.raises(ConfigError, match="threshold"):
        lmeval.model_settings(str(LLADA), threshold="high")
    with pytest.raises(ConfigError, match="pretrained"):
        lmeval.model_settings(None)
    with pytest.raises(ConfigError, match="unknown decode preset"):
        lmeval.model_settings(str(LLADA), preset="nope")
    assert lmeval.model_settings(str(LLADA), mesh="tp=2;dp=2").mesh == dlm_jax.MeshShape(tp=2, dp=2)
    with pytest.raises(ConfigError, match="mesh 'tq=2': unknown axis 'tq'"):
        lmeval.model_settings(str(LLADA), mesh="tq=2")
    # lm-eval's own settings (its CLI always passes batch_size) give way to model_args
    lm = lmeval.DlmJaxLM.create_from_arg_string(f"pretrained={LLADA},executor=jax,batch_size=4",
                                                {"batch_size": 1, "max_batch_size": None, "device": "cuda"})
    assert lm.batch_size == 4


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_help_write_tasks_and_one_line_errors(tmp_path, capsys):
    assert cli_main(["lm-eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "mc_num" in out and "--write-tasks" in out and "block_len" in out
    assert cli_main(["lm-eval", "--write-tasks", str(tmp_path / "t"), "--n", "2", "--tasks", "addition"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"] == ["dlmjax_addition", "dlmjax_addition_mc"]
    assert (tmp_path / "t" / "dlmjax_scoring.py").exists()
    argv = ["lm-eval", "--model", "dlm-jax", "--model_args", f"pretrained={LLADA},mc_num=100", "--tasks", "x"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: model arg mc_num=100 must be a multiple of mc_batch=32"]


def test_without_lm_eval_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "dlm_jax.frontends.lmeval", raising=False)
    assert cli_main(["lm-eval", "--help"]) == 2
    assert capsys.readouterr().err == "error: lm-eval is not installed: pip install 'dlm-jax[lmeval]'\n"


def test_module_entry_point_ends_a_bad_model_arg_in_one_error_line(hf_sandbox):
    argv = [sys.executable, "-m", "dlm_jax.frontends.lmeval", "--model", "dlm-jax", "--model_args",
            f"pretrained={LLADA},bogus=1", "--tasks", "dlmjax_addition"]
    run = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **hf_sandbox}, timeout=300)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown dlm-jax model arg(s) bogus; known:"), run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_cli_run_scores_as_dlm_jax_eval_and_unknown_tasks_fail_in_one_line(hf_sandbox, task_dir, tmp_path):
    """The whole command line (lm-eval indexes its own tasks too: tens of seconds)."""
    from dlm_jax.training.evaluate import evaluate

    base = [sys.executable, "-m", "dlm_jax.frontends.cli", "lm-eval", "--model", "dlm-jax", "--model_args",
            f"pretrained={LLADA},executor=jax,preset=fast-dllm,gen_len=64", "--include_path", str(task_dir)]
    env = {**os.environ, **hf_sandbox}
    run = subprocess.run([*base, "--tasks", "dlmjax_sorting", "--batch_size", "8", "--output_path", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    handle = dlm_jax.load(LLADA, executor="jax")
    report = evaluate(handle, "sorting", dlm_jax.preset("fast-dllm", gen_len=64), n=N, max_batch=8, progress=False)
    assert result["results"]["dlmjax_sorting"]["exact_match,none"] == report["accuracy"]
    assert "dlmjax_sorting" in run.stdout  # lm-eval's table
    run = subprocess.run([*base, "--tasks", "no_such_task"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == "error: Tasks not found: no_such_task"
