"""The GPU check's summary, read from the logs that benchmarks/gpu_check.sh wrote under its folder.

    python benchmarks/gpu_check_summary.py OUT --budget 600 --optional test_other
    python benchmarks/gpu_check_summary.py OUT --preflight

On a GPU run it prints the details first (GPU and versions, op builds, kernel rows, speed targets, the engines' rows)
and the short table of steps last, each with its exit status, seconds and result, then one verdict line. The CPU
pre-flight prints one line. The exit status is 1 when a step failed, or was skipped for lack of time without being
optional, else 0. Standard library only: it runs whatever the install step managed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]
PYTEST_WORDS = (" passed", " failed", " error", " skipped", " deselected", "no tests ran", " collected")
PARAMETER_KEYS = ("outputs", "group_size", "in_bits", "pieces", "stochastic", "hadamard")
SHORT_KEYS = {"group_size": "g", "stochastic": "sr", "hadamard": "had"}


@dataclass(frozen=True)
class Step:
    """One line of steps.tsv: a step's name, exit status ('skipped' when the budget ran out), seconds and log."""

    name: str
    rc: str
    seconds: int
    log: str

    @property
    def failed(self) -> bool:
        """Whether the step ran and did not succeed."""
        return self.rc not in ("0", "skipped")


def read_steps(out: Path) -> list[Step]:
    """The steps in the order they ran."""
    path = out / "steps.tsv"
    lines = path.read_text().splitlines() if path.exists() else []
    return [Step(n, rc, int(s), log) for n, rc, s, log in (line.split("\t") for line in lines if line.count("\t") == 3)]


def segment(out: Path, step: Step) -> list[str]:
    """What a step wrote into its log: the lines after its own `== name (limit ...)` header, up to the next one."""
    path = out / step.log
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    found: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("== ") and " (limit " in line:
            inside = line.startswith(f"== {step.name} (limit ")
            continue
        if inside:
            found.append(line)
    return found


def json_rows(lines: list[str]) -> list[Row]:
    """The JSON objects among a log's lines (the benchmarks print one per line)."""
    rows = []
    for line in lines:
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def last_matching(lines: list[str], words: tuple[str, ...]) -> str | None:
    """The last line holding one of `words` (pytest's closing line), stripped of its `=` rule."""
    found = [line for line in lines if any(w in line for w in words) and not line.startswith("SKIPPED")]
    return found[-1].strip("= ") if found else None


def last_line(lines: list[str]) -> str:
    """The last non-empty line: what a failed step said last."""
    found = [line.strip() for line in lines if line.strip()]
    return found[-1] if found else "no output"


def engines_result(rows: list[Row]) -> str:
    """One word per stage's engine row, and the codec backend they used."""
    if not rows:
        return "no engine row"
    words = [f"ZeRO-{r['stage']} " + ("FAILED" if "error" in r else f"{r['s_per_step']:.3f} s/step") for r in rows]
    backends = sorted({str(r["backend"]) for r in rows if "backend" in r})
    return ", ".join(words) + (f", codec {'/'.join(backends)}" if backends else "")


def targets_result(rows: list[Row]) -> str:
    """How many speed targets passed, failed or could not be judged."""
    verdicts = [{True: "PASS", False: "FAIL", None: "n/a"}[r["passed"]] for r in rows if "target" in r]
    counts = {v: verdicts.count(v) for v in ("PASS", "FAIL", "n/a")}
    return f"{len(rows) - len(verdicts)} rows, targets " + ", ".join(f"{n} {v}" for v, n in counts.items())


def result(out: Path, step: Step) -> str:
    """A step's result in a few words: its closing line, its rows, or why it failed."""
    if step.rc == "skipped":
        return "not run: the budget was used up"
    lines = segment(out, step)
    if step.rc == "124":
        return f"hit its time limit; last: {last_line(lines)}"
    if step.name.startswith(("test_", "collect")):
        return last_matching(lines, PYTEST_WORDS) or last_line(lines)
    if step.name == "build":
        return ", ".join(line.removeprefix("BUILD ") for line in lines if line.startswith("BUILD ")) or last_line(lines)
    if step.name == "engines":
        return engines_result(json_rows(lines))
    if step.name.startswith("bench_"):
        rows = json_rows(lines)
        errors = sum(1 for r in rows if r.get("error"))
        return targets_result(rows) if any("target" in r for r in rows) else f"{len(rows)} rows, {errors} errors"
    if step.name == "env" and not step.failed:
        gpu = [line for line in lines if "MHz" in line]
        return gpu[0] if gpu else last_line(lines)
    return "ok" if step.name in ("install", "provenance") and not step.failed else last_line(lines)


def kernel_table(rows: list[Row]) -> list[str]:
    """The kernel benchmarks' rows: op, backend, dtype, bits, parameters, ms and GB/s."""
    table = [f"{'op':<27}{'backend':<10}{'dtype':<6}{'bits':>4} {'parameters':<40}{'ms':>9}{'GB/s':>8}"]
    for r in rows:
        if "target" in r:
            continue
        extra = " ".join(f"{SHORT_KEYS.get(k, k)}={r[k]}" for k in PARAMETER_KEYS if k in r).replace("outputs=", "")
        ms = "-" if r.get("ms") is None else f"{r['ms']:.4f}"
        gbps = r.get("gbps") if r.get("gbps") is not None else ("ERR" if r.get("error") else "-")
        table.append(
            f"{str(r.get('op'))[:26]:<27}{str(r.get('backend'))[:9]:<10}{str(r.get('dtype', '')):<6}"
            f"{str(r.get('bits', '')):>4} {extra[:39]:<40}{ms:>9}{gbps!s:>8}"
        )
    return table


def target_lines(rows: list[Row]) -> list[str]:
    """The speed targets (set for an H200), each PASS, FAIL or n/a with the value and the goal."""
    lines = ["speed targets (set for an H200):"]
    for r in rows:
        if "target" in r:
            verdict = {True: "PASS", False: "FAIL", None: "n/a"}[r["passed"]]
            lines.append(f"  {verdict:<5}{r['target']:<62}{r['value']!s:>8}  {r['goal']}")
    return lines


def engine_lines(rows: list[Row]) -> list[str]:
    """The engines' rows: one line per ZeRO stage."""
    lines = [] if rows else ["  no engine row"]
    for r in rows:
        if "error" in r:
            lines.append(f"  ZeRO-{r['stage']}: FAILED: {r['error']}")
            continue
        lines.append(
            f"  ZeRO-{r['stage']} on {r['device']}: {r['steps']} steps, loss {r['loss_first']:.4f} -> "
            f"{r['loss_last']:.4f}, {r['s_per_step']:.4f} s/step (first {r['first_step_s']:.2f} s, init "
            f"{r['init_s']:.1f} s), codec {r['backend']} ({r['codec_calls']} calls), stats total: wire "
            f"{r['wire_bytes']} B, logical {r['logical_bytes']} B"
        )
    return lines


def details(out: Path, steps: list[Step]) -> list[str]:
    """What a GPU run measured, before the short table: versions, builds, kernel rows, targets, engines."""
    by_name = {s.name: s for s in steps}
    lines = ["", "== GPU check: details =="]
    if "env" in by_name:
        lines += ["  " + line for line in segment(out, by_name["env"])[:8]]
    if "build" in by_name:
        lines += ["  " + line for line in segment(out, by_name["build"]) if line.startswith("BUILD ")]
    kernels = [
        r
        for name in ("bench_kernels", "bench_zeropp")
        if name in by_name
        for r in json_rows(segment(out, by_name[name]))
    ]
    if kernels:
        lines += ["", *kernel_table(kernels), "", *target_lines(kernels)]
    if "engines" in by_name:
        lines += [
            "",
            "engines (one rank, the README's block):",
            *engine_lines(json_rows(segment(out, by_name["engines"]))),
        ]
    return lines


def table(out: Path, steps: list[Step]) -> list[str]:
    """The short table: one line per step with its exit status, seconds and result."""
    lines = ["", "== GPU check summary ==", f"{'step':<14}{'exit':>8}{'s':>6}  result"]
    for s in steps:
        lines.append(f"{s.name:<14}{s.rc:>8}{s.seconds:>6}  {result(out, s)[:90]}")
    return lines


def verdict(steps: list[Step], optional: set[str]) -> tuple[bool, str]:
    """Whether the check passed, and the steps that made it fail."""
    bad = [
        f"{s.name} ({'skipped' if s.rc == 'skipped' else f'exit {s.rc}'})"
        for s in steps
        if s.failed or (s.rc == "skipped" and s.name not in optional)
    ]
    return not bad and bool(steps), ", ".join(bad) or ("no step ran" if not steps else "")


def gpu_summary(out: Path, steps: list[Step], optional: set[str], budget: int, seconds: int) -> tuple[bool, list[str]]:
    """The GPU run's summary: details, then the short table and the verdict last."""
    ok, bad = verdict(steps, optional)
    last = f"gpu_check: {'PASS' if ok else 'FAIL: ' + bad} ({len(steps)} steps, {seconds} s of the {budget} s budget)"
    return ok, [*details(out, steps), *table(out, steps), last]


def preflight_summary(out: Path, steps: list[Step], seconds: int) -> tuple[bool, list[str]]:
    """The CPU pre-flight's one line (after the failed steps' last log lines, when one failed)."""
    ok, bad = verdict(steps, set())
    if not ok:
        tails = [line for s in steps if s.failed for line in [f"--- {s.name} ({s.log}):", *segment(out, s)[-12:]]]
        return False, [*tails, f"gpu_check pre-flight: FAIL: {bad} after {seconds} s"]
    facts = "; ".join(f"{s.name}: {result(out, s)}" for s in steps if result(out, s) != "ok")
    return True, [f"gpu_check pre-flight: PASS in {seconds} s: {facts}"]


def main(argv: list[str] | None = None) -> int:
    """Print the summary; 0 when the check passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the check's log folder")
    parser.add_argument("--preflight", action="store_true", help="the CPU pre-flight's one line")
    parser.add_argument("--budget", type=int, default=600, help="the overall budget in seconds, for the verdict line")
    parser.add_argument("--seconds", type=int, default=0, help="the seconds the check took so far")
    parser.add_argument("--optional", default="", help="comma-separated steps that may be skipped for lack of time")
    args = parser.parse_args(argv)
    steps = read_steps(args.out)
    if args.preflight:
        ok, lines = preflight_summary(args.out, steps, args.seconds)
    else:
        optional = set(filter(None, args.optional.split(",")))
        ok, lines = gpu_summary(args.out, steps, optional, args.budget, args.seconds)
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
