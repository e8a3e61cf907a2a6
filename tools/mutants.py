"""Mutation check: plant known bugs in a copy of kiln/ and show that the tests meant to catch each one fail.

Each row of MUTANTS replaces one exact snippet of a file under kiln/ (it must occur there exactly once) with a
realistic bug, and names the few tests that should catch it. For each selected row the script copies kiln/,
tests/ and pyproject.toml into a fresh temporary directory, applies the replacement there and runs those tests
in one pytest process with that directory as cwd and PYTHONPATH, so `import kiln` finds the mutated copy ahead
of the repo's editable install (checked before every run). Results: caught (pytest exit 1, tests failed),
MISSED (exit 0), error (anything else: a collection error, a timeout, a snippet that is not there once).

    .venv/bin/python tools/mutants.py --list                  # the mutants, nothing run
    .venv/bin/python tools/mutants.py --dry-run               # copy, apply and check the imports only
    .venv/bin/python tools/mutants.py --baseline              # each row's tests on the unmutated copy first
    .venv/bin/python tools/mutants.py --only NAME[,NAME] --jobs 2

It ends with a Markdown table, and exits 1 when a mutant is missed or errors or a baseline does not pass.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
T = "tests/test_"  # the tests' prefix, so that a row's node ids fit its lines


@dataclass(frozen=True)
class Mutant:
    name: str  # short id, for --only
    what: str  # the bug it plants
    path: str  # the file under kiln/
    old: str  # exact source, found once in that file
    new: str  # its replacement
    tests: list[str]  # pytest node ids that should catch it


# fmt: off
MUTANTS = [
    Mutant("radix_match_off_by_one", "a prefix match counts the first mismatching token as cached",
           "kiln/memory/radix_cache.py", "return i // self.page_size * self.page_size",
           "return (i + 1) // self.page_size * self.page_size",
           [T + "radix_cache.py::test_match_after_insert", T + "radix_cache.py::test_split_at_boundary"]),
    Mutant("sampler_top_k_ignored", "the vectorised sampling filters drop the top-k mask",
           "kiln/runner/sampler.py", "keep = torch.arange(width, device=vals.device) < top_k.unsqueeze(-1)",
           "keep = torch.ones_like(vals, dtype=torch.bool)",
           [T + "sampler.py::test_top_k_restricts_to_k_best"]),
    Mutant("ledger_kv_one_layer_short", "the ledger's KV bytes per token count one layer too few",
           "kiln/models/shapes.py", "return (k + v) * kv_layers(cfg) * element_bytes",
           "return (k + v) * (kv_layers(cfg) - 1) * element_bytes",
           [T + "ledger.py::test_kv_bytes_per_token_public_models"]),
    Mutant("retracted_request_dropped", "a retracted request is freed but never requeued",
           "kiln/scheduler/scheduler.py", "self.waiting.appendleft(r)", "pass",
           [T + "scheduler.py::test_retraction_under_a_tiny_pool_keeps_every_request"]),
    Mutant("stop_prefix_not_held_back", "streamed text ending in the start of a stop string is not held back",
           "kiln/text/detokenizer.py", "keep = 0 if final or not self.stop else",
           "keep = 0 if final or self.stop else",
           [T + "detokenizer.py::test_holds_back_partial_stop_then_releases"]),
    Mutant("release_frees_cached_prefix", "releasing a request also frees the prefix-cache pages it borrowed",
           "kiln/scheduler/kv.py", "self.allocator.free(self._slots(req, req.kv_len)[req.cached_len :])",
           "self.allocator.free(self._slots(req, req.kv_len))",
           [T + "kv_manager.py::test_finished_sequence_is_cached_and_matched"]),
    Mutant("free_list_merged_twice", "freed pages stay queued after joining the free list (handed out twice)",
           "kiln/memory/allocator.py", "self._released = []", "pass",
           [T + "allocator.py::test_random_ops_never_hand_out_a_slot_twice"]),
    Mutant("chunk_boundary_off_by_one", "a prefill chunk takes one token less than --chunked-prefill-size",
           "kiln/scheduler/kv.py", "else limit // self.page_size * self.page_size",
           "else (limit - 1) // self.page_size * self.page_size",
           [T + "scheduler.py::test_long_prompt_is_prefilled_in_chunks"]),
    Mutant("aborted_request_keeps_running", "an aborted request stays in the running batch",
           "kiln/scheduler/scheduler.py",
           "        if req in self.running:\n"
           "            self.running.remove(req)\n", "",
           [T + "scheduler.py::test_abort_one_request_leaves_the_others"]),
    Mutant("spec_greedy_accepts_unverified", "greedy verification accepts every draft token unchecked",
           "kiln/speculative/verify.py", "while n < len(draft) and chosen[n] == draft[n]:",
           "while n < len(draft):",
           [T + "speculative.py::test_wrong_and_random_drafters_identical"]),
    Mutant("spec_sampled_accepts_all", "speculative sampling accepts a draft without the p/q test",
           "kiln/speculative/verify.py", "if q_x > 0.0 and _uniform(generator) < min(1.0, p_x / q_x):",
           "if q_x > 0.0:",
           [T + "speculative.py::test_speculative_sampling_keeps_the_target_distribution"]),
    Mutant("tool_parameters_dropped", "arguments under \"parameters\" (Llama 3, tool_choice) are not read",
           "kiln/text/tool_parsers/formats.py",
           "elif key in argument_keys and draft.arguments_start is None:",
           "elif key == \"arguments\" and draft.arguments_start is None:",
           [T + "tool_parsers.py::test_whole_output"]),
    Mutant("cached_tokens_reported_live", "cached_tokens reports the current lock, not the hit at admission",
           "kiln/scheduler/output.py", "cached_tokens=req.cached_tokens,", "cached_tokens=req.cached_len,",
           [T + "scheduler.py::test_cached_prefix_is_reused"]),
    Mutant("max_tokens_off_by_one", "a request runs one token past max_new_tokens",
           "kiln/scheduler/output.py", "elif len(req.output_ids) >= p.max_new_tokens",
           "elif len(req.output_ids) > p.max_new_tokens",
           [T + "scheduler.py::test_outputs_follow_the_model"]),
    Mutant("min_tokens_stop_string_late", "stop strings come live one token after min_new_tokens",
           "kiln/scheduler/output.py", "return len(req.output_ids) >= req.params.min_new_tokens",
           "return len(req.output_ids) > req.params.min_new_tokens",
           [T + "detokenizer.py::test_stop_string_waits_for_min_new_tokens"]),
    Mutant("min_tokens_eos_ban_late", "EOS and stop ids stay banned one token past min_new_tokens",
           "kiln/scheduler/output.py", "if len(req.output_ids) + ahead >= req.params.min_new_tokens:",
           "if len(req.output_ids) + ahead > req.params.min_new_tokens:",
           [T + "scheduler.py::test_eos_is_banned_for_exactly_min_new_tokens"]),
    Mutant("top_logprobs_one_short", "top_logprobs returns one entry fewer than asked",
           "kiln/runner/sampler.py", "n = p.top_logprobs_num", "n = p.top_logprobs_num - 1",
           [T + "sampler.py::test_logprobs_equal_log_softmax_of_raw_logits"]),
    Mutant("integrity_counts_tokens", "the integrity check counts a request's tokens, not its pages",
           "kiln/scheduler/kv.py", "sum(self._pages(r.kv_len - r.cached_len) for r",
           "sum((r.kv_len - r.cached_len) for r",
           [T + "kv_manager.py::test_admit_allocates_pages_and_a_row"]),
    Mutant("integrity_passes_a_leak", "the integrity check reads a pool with leaked slots as whole",
           "kiln/scheduler/kv.py", "\"ok\": free + cached + in_use == total",
           "\"ok\": free + cached + in_use <= total",
           [T + "scheduler.py::test_integrity_reports_a_leaked_slot_and_counts_it"]),
    Mutant("commit_past_a_stop", "a verified draft path is committed past the token that ended the request",
           "kiln/scheduler/scheduler.py", "            if req.finished:\n                break\n",
           "            if req.finished and len(tokens) == 1:\n                break\n",
           [T + "speculative.py::test_chains_cut_at_stop_ids_stop_strings_and_max_tokens"]),
]
# fmt: on
assert len({m.name for m in MUTANTS}) == len(MUTANTS), "mutant names must be unique"


class MutationError(Exception):
    pass


@dataclass
class Run:
    rc: int | None  # None: killed at the timeout
    seconds: float
    tail: str


def env_for(copy: Path) -> dict[str, str]:
    # no .pyc: a baseline run's bytecode of the unmutated file must never stand in for the mutated one
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def make_copy(copy: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for folder in ("kiln", "tests"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")


def apply(m: Mutant, copy: Path) -> str:
    """Plants the bug in the copy; returns the file's text before."""
    file = copy / m.path
    text = file.read_text()
    if (count := text.count(m.old)) != 1:
        raise MutationError(f"{m.name}: the snippet occurs {count} times in {m.path}, not once: {m.old!r}")
    file.write_text(text.replace(m.old, m.new))
    return text


def check_imports(m: Mutant, copy: Path) -> None:
    """kiln is installed editable in the venv: the package and the mutated module must come from the copy."""
    module = m.path.removesuffix(".py").replace("/", ".")
    code = f"import importlib.util as u, kiln; print(kiln.__file__); print(u.find_spec({module!r}).origin)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=120
    )
    paths = done.stdout.split()
    if done.returncode or len(paths) != 2 or not all(Path(p).is_relative_to(copy) for p in paths):
        raise MutationError(f"{m.name}: kiln is not imported from {copy}: {paths} {done.stderr[-500:]}")


def run_pytest(copy: Path, tests: list[str], timeout: float) -> Run:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", *tests]
    start = time.monotonic()
    # a session of its own, so that a timeout also ends the engines and servers the tests started
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env_for(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, rc = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, rc = proc.communicate()[0], None
    return Run(rc, time.monotonic() - start, "\n".join(out.splitlines()[-30:]))


def verdict(run: Run) -> str:
    if run.rc is None:
        return "error (timeout)"
    return {0: "MISSED", 1: "caught"}.get(run.rc, f"error (exit {run.rc})")


def check(m: Mutant, baseline: bool, dry_run: bool, timeout: float) -> tuple[str, str, float]:
    """(baseline, result, seconds of the mutant's run) for one row, in a copy of its own."""
    base = "-"
    with tempfile.TemporaryDirectory(prefix=f"kiln-mutant-{m.name}-") as tmp:
        copy = Path(tmp).resolve()
        make_copy(copy)
        try:
            original = apply(m, copy)  # first, so that a stale snippet is refused before any test runs
            check_imports(m, copy)
        except MutationError as e:
            print(e, file=sys.stderr)
            return base, "error (mutation)", 0.0
        if dry_run:
            return base, "applied", 0.0
        if baseline:
            (copy / m.path).write_text(original)
            run = run_pytest(copy, m.tests, timeout)
            base = "pass" if run.rc == 0 else f"FAIL ({verdict(run)})"
            if run.rc != 0:
                print(f"{m.name}: baseline did not pass:\n{run.tail}", file=sys.stderr)
                return base, "not run", 0.0
            apply(m, copy)
        run = run_pytest(copy, m.tests, timeout)
    result = verdict(run)
    print(f"{m.name}: {result} in {run.seconds:.1f} s", file=sys.stderr)
    if result != "caught":
        print(run.tail, file=sys.stderr)
    return base, result, run.seconds


def table(rows: list[tuple[Mutant, str, str, float]]) -> str:
    lines = ["| name | what | file | tests | baseline | result | seconds |", "|---|---|---|---|---|---|---|"]
    for m, base, result, seconds in rows:
        tests = ", ".join(t.removeprefix("tests/") for t in m.tests)
        file = m.path.removeprefix("kiln/")
        lines.append(f"| {m.name} | {m.what} | {file} | {tests} | {base} | {result} | {seconds:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--baseline", action="store_true", help="each row's tests must pass unmutated")
    ap.add_argument("--dry-run", action="store_true", help="copy, apply and check the imports; no pytest")
    ap.add_argument("--jobs", type=int, default=1, help="mutants checked at once (one pytest process each)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run")
    args = ap.parse_args()
    chosen = MUTANTS
    if args.only:
        names = args.only.split(",")
        if unknown := sorted(set(names) - {m.name for m in MUTANTS}):
            ap.error(f"unknown mutants: {', '.join(unknown)}")
        chosen = [m for m in MUTANTS if m.name in names]
    if args.list:
        print(table([(m, "-", "-", 0.0) for m in chosen]))
        return 0
    start = time.monotonic()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda m: check(m, args.baseline, args.dry_run, args.timeout), chosen))
    rows = [(m, *r) for m, r in zip(chosen, results)]
    print(table(rows))
    print(f"\n{len(rows)} mutants in {time.monotonic() - start:.0f} s")
    ok = {"caught", "applied"}
    return 0 if all(r in ok and b in ("-", "pass") for _, b, r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
