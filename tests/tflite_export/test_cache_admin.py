"""The bundle cache's upkeep (`dlm_jax.executors.bundle_cache`, `dlm_jax.tflite_export.cache_admin`).

An entry exported into twice holds one part and one copy of the weights; a process that had
a merged-away part open keeps decoding, and one that finds a part gone between listing and
opening lists again; two exporters into one entry at once end with one part holding both
sets of buckets. The cache stays within `$DLM_JAX_BUNDLE_CACHE_MB` by evicting the least
recently used entries, never the one in use or one being exported into; `dlm-jax cache
list` / `cache clear` report and remove entries, and bad input is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.frontends.cli import main
from dlm_jax.executors.runner import Bundle
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.tflite_export import cache_admin
from dlm_jax.tflite_export.bundle import _Sizes, parse_bucket
from dlm_jax.executors.bundle_cache import BundleCacheExecutor, model_fingerprint

TINY = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"
DECODE = dlm_jax.decode_config(cache="dual", gen_len=32)
PROMPTS = ["564+894=", "12+34=46 56+78=134 90+12=102 345+67=412 564+894="]  # buckets of their own each
MB = cache_admin.MB


@pytest.fixture(scope="module")
def jax_model():
    return dlm_jax.load(TINY, executor="jax")


@pytest.fixture(scope="module")
def ids(jax_model):
    return [jax_model.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def keys(jax_model, ids):
    """The buckets of each prompt's decode (two each, none shared)."""
    decoder = Decoder(_Sizes(jax_model.config), jax_model.config)
    return [decoder.bucket_keys([len(i)], DECODE) for i in ids]


@pytest.fixture(scope="module")
def want(jax_model, ids):
    """The JAX executor's tokens for each prompt (the cache decodes exactly these)."""
    return [jax_model.decoder.decode([i], DECODE).sequences[0].tolist() for i in ids]


def _executor(jax_model, root: Path) -> BundleCacheExecutor:
    return BundleCacheExecutor(jax_model.model, source=TINY, root=root)


def _decode(executor: BundleCacheExecutor, prompt: list[int]) -> list[int]:
    return Decoder(executor, executor.config).decode([prompt], DECODE).sequences[0].tolist()


@pytest.fixture(scope="module")
def grown(jax_model, keys, ids, tmp_path_factory):
    """An entry exported into twice by two executors: the first's part is merged away by the
    second's export. Returns (first, second, the first's tokens before the merge)."""
    root = tmp_path_factory.mktemp("grown")
    first = _executor(jax_model, root)
    first.warmup(keys[0])
    before = _decode(first, ids[0])
    second = _executor(jax_model, root)
    second.warmup(keys[1])
    return first, second, before


def test_two_exports_leave_one_part_with_every_bucket_and_one_copy_of_the_weights(grown, keys):
    first, second, _ = grown
    assert first.exported == sorted(keys[0]) and second.exported == sorted(keys[1])  # nothing converted twice
    [part] = sorted(second.path.glob("part-*"))
    assert sorted(Bundle.open(part).keys) == sorted(keys[0] + keys[1])
    assert not [p for p in second.path.iterdir() if p.name.startswith(".")]  # no temporary left
    weights = 4 * dlm_jax.param_count(first.config)
    assert cache_admin.tree_bytes(second.path) < 1.2 * weights


def test_an_executor_keeps_decoding_from_a_part_merged_away(grown, ids, want):
    first, _, before = grown
    [old] = first.parts_open
    assert not old.exists()
    assert _decode(first, ids[0]) == before == want[0]


def test_a_later_process_decodes_every_bucket_from_the_merged_part_without_exporting(grown, jax_model, ids, want):
    again = _executor(jax_model, grown[0].path.parent)
    assert [_decode(again, i) for i in ids] == want
    assert again.exported == [] and len(again.parts_open) == 1


def test_a_part_vanishing_between_listing_and_opening_is_looked_up_again(grown, jax_model, ids, want, tmp_path):
    entry = grown[0].path
    shutil.copytree(entry, tmp_path / entry.name)
    executor = _executor(jax_model, tmp_path)
    listed = executor._scan

    def scan_then_move():  # another process compacts the entry right after this one listed it
        parts = listed()
        for p in parts:
            p.rename(p.with_name("part-moved"))
        executor._scan = listed
        return parts

    executor._scan = scan_then_move
    assert _decode(executor, ids[0]) == want[0]
    assert executor.exported == [] and executor.parts_open == [tmp_path / entry.name / "part-moved"]


def test_two_exporters_at_once_end_with_one_part_holding_both_their_buckets(jax_model, keys, ids, want, tmp_path):
    executors = [_executor(jax_model, tmp_path) for _ in keys]
    start = threading.Barrier(len(executors))
    errors = []

    def export(executor, k):
        try:
            start.wait()
            executor.warmup(k)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=export, args=(e, k)) for e, k in zip(executors, keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    [part] = sorted(executors[0].path.glob("part-*"))
    assert sorted(Bundle.open(part).keys) == sorted(keys[0] + keys[1])
    assert sorted(executors[0].exported + executors[1].exported) == sorted(keys[0] + keys[1])
    for executor in executors:
        assert [_decode(executor, i) for i in ids] == want


def test_a_merge_refused_exports_every_bucket_again_as_one_part(grown, jax_model, keys, tmp_path, monkeypatch):
    shutil.copytree(grown[0].path, tmp_path / grown[0].path.name)

    def refuse(parts, out):
        raise ConfigError("not mergeable")

    monkeypatch.setattr("dlm_jax.tflite_export.merge.merge_bundles", refuse)
    executor = _executor(jax_model, tmp_path)
    added = parse_bucket("step_w128_p0_r32")
    executor.warmup([added])
    [part] = sorted(executor.path.glob("part-*"))
    assert sorted(Bundle.open(part).keys) == sorted(keys[0] + keys[1] + [added])
    assert executor.exported == [added]


# -- size limit and eviction ------------------------------------------------------------------------


def _fake_entry(root: Path, name: str, size: int, *, age: float = 0.0, source: str | None = None,
                parts: int = 1) -> Path:
    """An entry with `parts` parts whose files hold `size` bytes in all, last used `age` s ago."""
    entry = root / name
    for i in range(parts):
        part = entry / f"part-{i:012x}"
        part.mkdir(parents=True)
        meta = {"buckets": [{"signature": f"step_w32_p{32 * i}_r32"}], **({"source": source} if source else {})}
        (part / "bundle.json").write_text(json.dumps(meta))
        (part / "model.tflite").write_bytes(b"\0" * (size // parts - (part / "bundle.json").stat().st_size))
    t = time.time() - age
    os.utime(entry, (t, t))
    return entry


def test_an_entry_size_is_the_lstat_bytes_of_its_files(tmp_path):
    entry = _fake_entry(tmp_path, "m-0123456789abcdef", 10_000, parts=2, source="/models/m")
    (entry / "part-000000000000" / "link").symlink_to("/usr")  # a link counts its own bytes, not its target's
    [found] = cache_admin.entries(tmp_path)
    files = [p for p in entry.rglob("*") if p.is_file() or p.is_symlink()]
    assert found.bytes == sum(os.lstat(p).st_size for p in files) == 10_000 + len("/usr")
    assert (found.source, found.fingerprint, found.parts, found.buckets) == ("/models/m", "0123456789abcdef", 2, 2)


def test_the_limit_is_dlm_jax_bundle_cache_mb_default_4096(monkeypatch):
    monkeypatch.delenv(cache_admin.LIMIT_ENV, raising=False)
    assert cache_admin.cache_limit() == 4096 * MB
    monkeypatch.setenv(cache_admin.LIMIT_ENV, "0.5")
    assert cache_admin.cache_limit() == MB // 2
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(cache_admin.LIMIT_ENV, bad)
        with pytest.raises(ConfigError, match=cache_admin.LIMIT_ENV):
            cache_admin.cache_limit()


def test_eviction_removes_the_least_recently_used_entries_until_within_the_limit(tmp_path):
    old, older, recent = (_fake_entry(tmp_path, f"{n}-{i:016x}", 1000, age=a)
                          for i, (n, a) in enumerate((("old", 200), ("older", 300), ("recent", 100))))
    assert [e.path for e in cache_admin.entries(tmp_path)] == [older, old, recent]
    removed = cache_admin.evict(tmp_path, 1500)
    assert [e.path for e in removed] == [older, old]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [recent.name]
    assert cache_admin.evict(tmp_path, 1000) == []  # within the limit: nothing goes


def test_eviction_never_removes_the_entry_in_use_nor_one_being_exported_into(tmp_path):
    in_use = _fake_entry(tmp_path, f"a-{1:016x}", 1000, age=300)
    exporting = _fake_entry(tmp_path, f"b-{2:016x}", 1000, age=200)
    idle = _fake_entry(tmp_path, f"c-{3:016x}", 1000, age=100)
    with cache_admin.entry_lock(exporting):  # another exporter holds its lock
        removed = cache_admin.evict(tmp_path, 0, keep=frozenset({in_use}))
    assert [e.path for e in removed] == [idle]
    assert in_use.exists() and exporting.exists() and not idle.exists()
    assert not [p for p in tmp_path.iterdir() if ".removed-" in p.name]


def test_an_export_evicts_least_recently_used_entries_but_not_its_own(grown, jax_model, keys, ids, want, tmp_path,
                                                                     monkeypatch):
    shutil.copytree(grown[0].path, tmp_path / grown[0].path.name)
    older = _fake_entry(tmp_path, f"older-{1:016x}", 3 * MB, age=3000)
    old = _fake_entry(tmp_path, f"old-{2:016x}", 3 * MB, age=2000)
    recent = _fake_entry(tmp_path, f"recent-{3:016x}", MB, age=1000)
    monkeypatch.setenv(cache_admin.LIMIT_ENV, "6")  # our entry (~3.7 MB) + recent fit, the old ones do not
    executor = _executor(jax_model, tmp_path)
    os.utime(executor.path, (time.time() - 9000,) * 2)  # the least recently used, but in use
    executor.warmup([parse_bucket("step_w128_p0_r32")])  # a bucket the entry lacks: one export
    assert executor.exported and [e.path for e in executor.evicted] == [older, old]
    assert executor.path.exists() and recent.exists() and not older.exists() and not old.exists()
    assert _decode(executor, ids[0]) == want[0]


# -- dlm-jax cache list / clear ---------------------------------------------------------------------


@pytest.fixture
def cli_cache(tmp_path, monkeypatch, jax_model):
    """A cache of three entries: llada-tiny's by fingerprint, one recording llada-tiny as its
    source (an older version's), another model's."""
    root = tmp_path / "bundles"
    monkeypatch.setenv(cache_admin.CACHE_ENV, str(root))
    monkeypatch.delenv(cache_admin.LIMIT_ENV, raising=False)
    by_fingerprint = _fake_entry(root, f"llada-tiny-{model_fingerprint(jax_model.model)}", 2 * MB, age=30,
                                 source="/elsewhere/llada-tiny", parts=2)
    by_source = _fake_entry(root, f"llada-tiny-{7:016x}", MB, age=20, source=str(TINY))
    other = _fake_entry(root, f"other-{8:016x}", MB, age=10, source="/models/other")
    return root, by_fingerprint, by_source, other


def test_cache_list_prints_each_entry_then_the_total_and_the_limit(cli_cache, capsys):
    root, *made = cli_cache
    assert main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["model", "fingerprint", "MB", "parts", "buckets", "last", "use"]
    assert [line.split()[:5] for line in lines[1:4]] == [
        ["/elsewhere/llada-tiny", made[0].name.rsplit("-", 1)[1], "2.0", "2", "2"],
        [str(TINY), f"{7:016x}", "1.0", "1", "1"], ["/models/other", f"{8:016x}", "1.0", "1", "1"]]
    assert lines[4] == f"total 4.0 MB in 3 entries of {root}; limit 4096 MB ($DLM_JAX_BUNDLE_CACHE_MB)"
    assert main(["cache", "list", "--json", "--model", str(TINY)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["path"] for e in listed["entries"]] == [str(p) for p in made[:2]]
    assert listed["total_mb"] == 3.0 and listed["limit_mb"] == 4096


def test_cache_clear_of_a_model_removes_its_entries_only_and_prints_the_mb_freed(cli_cache, capsys):
    root, by_fingerprint, by_source, other = cli_cache
    assert main(["cache", "clear", "--model", str(TINY)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("removed /elsewhere/llada-tiny") and out[1].startswith(f"removed {TINY}")
    assert out[2] == f"freed 3.0 MB (2 entries) in {root}"
    assert not by_fingerprint.exists() and not by_source.exists() and other.exists()
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"freed 1.0 MB (1 entry) in {root}"
    assert not [p for p in root.iterdir() if p.is_dir()]


@pytest.mark.parametrize("argv, message", [
    (["cache", "clear", "--model", "/no/such/model"], "/no/such/model: no such checkpoint directory"),
    (["cache", "list", "--model", "{tmp}"], "is not a readable checkpoint"),
    (["cache", "list"], "DLM_JAX_BUNDLE_CACHE_MB='lots' is not a size in MB"),
])
def test_cache_commands_name_bad_input_in_one_line(argv, message, cli_cache, tmp_path, capsys, monkeypatch):
    if argv == ["cache", "list"]:
        monkeypatch.setenv(cache_admin.LIMIT_ENV, "lots")
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err
    assert all(p.exists() for p in cli_cache[1:])
