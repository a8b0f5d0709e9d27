"""llama.cpp's diffusion CLI (`llama-diffusion-cli`) as a peer: built once from the package
registry, run on GGUF files this project writes (`dlm-jax export --format gguf`).

The full llama.cpp source, `examples/diffusion` included, ships in the `llama-cpp-python`
source distribution (`vendor/llama.cpp`). `build()` downloads it with pip (no other network),
configures it with CMake (static libraries, so the binary can be moved; `GGML_NATIVE` for this
CPU) and builds the one target, about 8 minutes on 2 cores, into
`$DLM_JAX_LLAMA_CPP_DIR` (default `~/.cache/dlm-jax/llama.cpp`). `$DLM_JAX_LLAMA_CPP` names a
binary built elsewhere.

How its decoding differs from this project's (read from `examples/diffusion/diffusion.cpp`):
- every step forwards the whole sequence (prompt + generation, `-ub` positions): no K/V cache;
- block schedule: `max_length / block` blocks starting at the prompt's end, so `max_length` must
  be a multiple of the block and the last block is cut at `max_length` (`RunShape`); each block
  gets `steps / blocks` steps and commits `get_num_transfer_tokens` per step (LLaDA's split);
- tokens are drawn by a sampler chain (top-k, top-p, temperature, then `dist`): with
  `--temp 0` there is no temperature stage and `dist` samples from the softmax; `--top-k 1`
  makes every token the argmax but then every confidence is 1 and ties go left to right, so
  confidence ordering is lost. `SAMPLED` (top-k 0, top-p 1, temp 0: samples at temperature 1,
  confidence = the sampled token's probability) keeps LLaDA's confidence ordering;
- it never stops early: every block runs all its steps, and text after an EOS stays (it is cut
  here at the first EOS character run, see `answer`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp with examples/diffusion
TARGET = "llama-diffusion-cli"
SAMPLED = ("--top-k", "0", "--top-p", "1.0", "--temp", "0")
_TIME = re.compile(r"total time: ([0-9.]+)ms, time per step: ([0-9.]+)ms")
_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [IWED] ", re.M)  # llama.cpp's log line prefix


def root() -> Path:
    return Path(os.environ.get("DLM_JAX_LLAMA_CPP_DIR") or Path.home() / ".cache" / "dlm-jax" / "llama.cpp")


def built_binary() -> Path | None:
    """The diffusion CLI: `$DLM_JAX_LLAMA_CPP`, else the one `build()` made, else None."""
    if env := os.environ.get("DLM_JAX_LLAMA_CPP"):
        return Path(env)
    path = root() / f"llama-cpp-python-{VERSION}" / "bin" / TARGET
    return path if path.exists() else None


def build(*, jobs: int = 2, log=print) -> Path:
    """Download the sdist, build `llama-diffusion-cli` statically, install it under `root()`."""
    if (binary := built_binary()) is not None:
        return binary
    dest = root() / f"llama-cpp-python-{VERSION}"
    root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root()) as tmp:
        tmp = Path(tmp)
        log(f"downloading llama-cpp-python=={VERSION} (source distribution)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(tmp)], check=True)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(tmp.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        log(f"configuring {src.name} (CMake, static, native)")
        subprocess.run(["cmake", "-S", str(src), "-B", str(tmp / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], check=True, stdout=subprocess.DEVNULL)
        log(f"building {TARGET} (about 8 minutes on 2 cores)")
        proc = subprocess.Popen(["cmake", "--build", str(tmp / "build"), "--target", TARGET, "-j", str(jobs)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            if m := re.match(r"\[(\d+)/(\d+)\]", line):
                print(f"\r  {m.group(1)}/{m.group(2)}", end="", file=sys.stderr, flush=True)
        if proc.wait():
            raise RuntimeError(f"building {TARGET} failed (exit {proc.returncode})")
        print(file=sys.stderr)
        staged = tmp / "install" / "bin"
        staged.mkdir(parents=True)
        shutil.copy2(tmp / "build" / "bin" / TARGET, staged / TARGET)
        os.replace(tmp / "install", dest)
    return dest / "bin" / TARGET


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The sequence llama.cpp decodes for a prompt of `n_input` tokens and a generation of at
    least `gen` with `block`-token blocks: `max_length` is rounded up to a whole number of
    blocks (counted from position 0), and `steps` must be a multiple of `blocks`."""

    n_input: int
    gen: int
    block: int  # 0: one region, the timestep schedule (`--diffusion-eps`)
    steps_per_block: int

    @property
    def max_length(self) -> int:
        n = self.n_input + self.gen
        return n if not self.block else -(-n // self.block) * self.block

    @property
    def blocks(self) -> int:
        return self.max_length // self.block if self.block else 1

    @property
    def steps(self) -> int:
        return self.blocks * self.steps_per_block

    def args(self) -> list[str]:
        n = str(self.max_length)
        schedule = ["--diffusion-block-length", str(self.block)] if self.block else ["--diffusion-eps", "0.001"]
        return ["-ub", n, "-b", n, "-c", n, *schedule, "--diffusion-steps", str(self.steps)]


@dataclasses.dataclass(frozen=True)
class Run:
    text: str  # everything generated after the prompt, as the CLI prints it
    total_ms: float  # the CLI's own timer around its decode loop (no load, no tokenisation)
    step_ms: float
    shape: RunShape


def diffuse(binary: Path, gguf: Path, prompt: str, shape: RunShape, *, threads: int = 2, seed: int = 0,
            sampling: tuple[str, ...] = SAMPLED, timeout: float = 600) -> Run:
    """One decode of `prompt` (rendered by the GGUF's chat template) by the diffusion CLI."""
    cmd = [str(binary), "-m", str(gguf), "-p", prompt, *shape.args(), "-t", str(threads), "-tb", str(threads),
           "--seed", str(seed), *sampling]
    for _ in range(3):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        parsed = parse_output(run.stdout + run.stderr)
        # Its logger writes from a thread of its own; on a loaded machine the last lines were
        # seen missing at exit (exit status 0): run again rather than fail the benchmark.
        if run.returncode == 0 and parsed is not None:
            return Run(*parsed, shape)
    raise RuntimeError(f"{binary.name} failed (exit {run.returncode}): {(run.stdout + run.stderr)[-1500:]}")


def parse_output(out: str) -> tuple[str, float, float] | None:
    """(generated text, total ms, ms per step) from the CLI's output; None without its timing line."""
    m = _TIME.search(out)
    if m is None:
        return None
    rest = _PREFIX.sub("", out[m.end():].split("\n", 1)[-1])  # the line(s) after the timing line
    text = rest[1:] if rest.startswith("\n") else rest  # printed as "\n<text>\n"
    text = text[:-1] if text.endswith("\n") else text
    return text, float(m.group(1)), float(m.group(2))
