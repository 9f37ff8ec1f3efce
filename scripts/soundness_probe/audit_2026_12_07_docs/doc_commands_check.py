"""Every `python -m certattn_jax ...` and `python scripts/*.py ...` command line in README.md and docs/*.md
(except docs/performance.md's GPU lab notes), parsed against the code as it is:
* certattn_jax commands: `cli._parser().parse_args(argv)`; for `eval`, also `evals.cli.build(args)` (the
  validation `run_eval` does before any run: modes, lengths vs the model's context, tasks, depths, sweeps);
  --audit-log is redirected into this folder (build opens it);
* scripts: every `--option` used must appear in the script's `--help`, and the script must exist."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                              if p.name != "performance.md")

def commands(path):
    text = (ROOT / path).read_text()
    lines = text.split("\n")
    found = []
    # fenced blocks: join "\" continuations
    in_block, buf, start = False, "", 0
    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            s = line.split("  #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if not buf:
                start = i
            buf += " " + s.rstrip("\\").strip() if s else ""
            if not s.endswith("\\"):
                if re.search(r"python (-m certattn_jax|scripts/)", buf):
                    found.append((start, buf.strip()))
                buf = ""
    # inline backticks (may span lines)
    prose = re.sub(r"```.*?```", lambda b: "\n" * b.group(0).count("\n"), text, flags=re.S)  # fences out
    for m in re.finditer(r"`([^`]*python (?:-m certattn_jax|scripts/)[^`]*)`", prose):
        line_no = prose[:m.start()].count("\n") + 1
        cmd = " ".join(m.group(1).split())
        found.append((line_no, cmd))
    return found

from certattn_jax import cli  # noqa: E402
from certattn_jax.evals import cli as ecli  # noqa: E402

help_cache = {}
results = []
seen = set()
for doc in DOCS:
    for line, cmd in commands(doc):
        key = cmd
        if key in seen:
            continue
        seen.add(key)
        try:
            toks = shlex.split(cmd)
        except ValueError as e:
            results.append((doc, line, cmd, f"unparseable shell: {e}"))
            continue
        # strip env assignments / wrappers
        while toks and ("=" in toks[0] and not toks[0].startswith("-")):
            toks.pop(0)
        if toks[:1] == ["/usr/bin/time"]:
            toks = toks[2:]
        if toks and toks[0].endswith("python"):
            toks = toks[1:]
        if "..." in toks or '"..."' in cmd or "{" in cmd or "|" in cmd.replace("||", ""):
            note = "template (placeholders) "
        else:
            note = ""
        if toks[:2] == ["-m", "certattn_jax"]:
            argv = toks[2:]
            if "..." in argv or "SOURCE" in argv or any("|" in a or a.startswith("{") for a in argv):
                # template: check option names only
                p = cli._parser()
                sub = p._subparsers._group_actions[0].choices.get(argv[0])
                opts = {o for a in sub._actions for o in a.option_strings} if sub else set()
                used = [re.split(r"[=\[\]]", a)[0] for a in " ".join(argv).replace("[", " ").split() if a.startswith("--")]
                miss = [u for u in used if u not in opts]
                results.append((doc, line, cmd, "template: options ok" if not miss and sub else f"MISMATCH: unknown {miss or argv[0]}"))
                continue
            argv = [str(HERE / "audit_log_probe.jsonl") if i > 0 and argv[i - 1] == "--audit-log" else a
                    for i, a in enumerate(argv)]
            try:
                args = cli._parser().parse_args(argv)
            except SystemExit as e:
                results.append((doc, line, cmd, f"FAILS argparse (exit {e.code})"))
                continue
            if args.command == "eval":
                try:
                    ecli.build(args)
                    res = "ok (parsed + eval build() validation)"
                except Exception as e:  # noqa: BLE001
                    res = f"FAILS build(): {type(e).__name__}: {e}"
            else:
                res = "ok (parsed)"
            results.append((doc, line, cmd, res))
        elif toks and toks[0].startswith("scripts/"):
            script = toks[0]
            if not (ROOT / script).exists():
                results.append((doc, line, cmd, f"FAILS: {script} does not exist"))
                continue
            if script not in help_cache:
                r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300)
                help_cache[script] = (r.returncode, r.stdout + r.stderr)
            rc, h = help_cache[script]
            used = [a.split("=")[0] for a in toks[1:] if a.startswith("--")]
            miss = [u for u in used if not re.search(re.escape(u) + r"\b", h)]
            if rc != 0:
                results.append((doc, line, cmd, f"--help rc={rc}: {h[-300:]}"))
            elif miss:
                results.append((doc, line, cmd, f"MISMATCH: options not in --help: {miss}"))
            else:
                results.append((doc, line, cmd, "ok (options in --help)"))
        else:
            results.append((doc, line, cmd, "skipped (not a python command)"))

for doc, line, cmd, res in results:
    print(f"{doc}:{line}\t{res}\t{cmd}")
