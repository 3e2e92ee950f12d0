"""The command line built from Config: every field a flag, presets, one-line refusals, old
checkpoints' configs."""

import dataclasses

import pytest

from config import Config, parse_config


def flags(argv):
    """The Config of a train.py command line."""
    return parse_config(argv)[0]


def test_every_config_field_is_a_flag_and_batch_size_alone_means_sentence_batches():
    config = flags(["--d_model", "256", "--h", "4", "--tie_embeddings", "decoder",
                           "--lr_schedule", "inverse_sqrt"])
    assert (config.d_model, config.h, config.tie_embeddings) == (256, 4, "decoder")
    assert config.lr_schedule == "inverse_sqrt" and config.max_tokens == 4096
    assert flags(["--batch_size", "32"]).max_tokens == 0
    both = flags(["--batch_size", "32", "--max_tokens", "2000"])
    assert (both.batch_size, both.max_tokens) == (32, 2000)


def test_a_presets_own_values_are_not_refused_as_typed():
    """The README's hour, `--preset multi30k_modern --time_budget 60`: the preset sets
    --num_epochs, which the user did not type beside the budget; and the write-ups' constant
    rate with its own (no) warm-up; the quick start's local files beside the preset's hub
    dataset."""
    config, _ = parse_config(["--preset", "multi30k_modern", "--time_budget", "60"])
    assert (config.num_epochs, config.time_budget) == (26, 60)
    assert parse_config(["--preset", "writeups"])[0].lr_schedule == "constant"
    assert parse_config(["--lr_schedule", "cosine", "--warmup", "100"])[0].warmup == 100
    assert parse_config(["--preset", "multi30k", "--lr_schedule", "constant"])[0].warmup == 0
    assert parse_config(["--preset", "multi30k_modern", "--data_dir", "d"])[0].data_dir == "d"


@pytest.mark.parametrize("argv, message", [
    (["--d_model", "100", "--h", "3"], "--d_model (100) must be divisible by --h (3)"),
    (["--N", "-2"], "--N must be positive"),
    (["--N_dec", "-1"], "--N_dec must not be negative"),
    (["--lang_src", "de", "--lang_tgt", "de"], "two different languages"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--time_budget", "nan"], "--time_budget must be a finite number (got nan)"),  # (a crash)
    (["--clip_grad", "inf"], "--clip_grad must be a finite number (got inf)"),
    (["--no_such_flag", "1"], "unrecognized argument"),  # (each parser then names the flag)
    (["--d_model", "big"], "invalid int value: 'big'"),
    (["--lr_schedule", "linear"], "invalid choice: 'linear'"),
    (["--preload", "yesterday"], "--preload must be latest, none or an epoch number"),
    (["--preload", "²"], "--preload must be latest, none or an epoch number"),  # a digit, no number
    (["--device", "gpu"], "--device must be auto, cpu, cuda, cuda:N or mps"),
    # an option typed where it would do nothing (a preset's own values are not typed)
    (["--time_budget", "60", "--num_epochs", "30"], "--num_epochs with --time_budget: the budget "
                                                    "sets the run's length"),
    (["--preset", "writeups", "--warmup", "100"], "--warmup with --lr_schedule constant: a "
                                                  "constant rate has no warm-up"),
    (["--data_dir", "d", "--datasource", "x/y"], "--datasource with --data_dir: the run reads "
                                                 "the files of --data_dir d; give one of them"),
])
def test_bad_flags_are_refused_with_one_line(argv, message, capsys):
    """Issue 70: without a parser given (a notebook, your code) a UserError of the same line
    (the default was argparse's own, whose errors print the usage)."""
    from config import UserError
    from nmt.cli import ArgumentParser  # train.py's, whose errors are one line
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv, ArgumentParser(prog="train.py"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    with pytest.raises(UserError) as error:
        parse_config(argv)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert capsys.readouterr() == ("", "")


def test_flags_beside_a_preset_win_over_its_token_batches():
    """9. --preset paper_base --batch_size 32 kept the preset's 25,000-token batches."""
    config, given = parse_config(["--preset", "paper_base", "--batch_size", "32"])
    assert (config.batch_size, config.max_tokens) == (32, 0) and "max_tokens" in given
    config, _ = parse_config(["--preset", "paper_base", "--batch_size", "32",
                              "--max_tokens", "8000"])
    assert config.max_tokens == 8000


@pytest.mark.parametrize("preset", ["paper_base", "paper_big"])
def test_the_papers_presets_train_as_section_5_says(preset):
    """Section 5: Adam's schedule at its exact values, residual dropout only, label smoothing
    0.1, post-norm with all three matrices shared, and no gradient clipping (the paper names
    none; the default clips at 1.0, which the presets kept until a review found it)."""
    config, _ = parse_config(["--preset", preset])
    assert config.clip_grad == 0.0
    assert (config.attention_dropout, config.activation_dropout) == (0.0, 0.0)
    assert (config.norm_first, config.tie_embeddings, config.shared_vocab) == (False, "all", True)
    assert config.label_smoothing == 0.1 and config.lr_schedule == "inverse_sqrt"
    assert config.lr == pytest.approx((config.d_model * config.warmup) ** -0.5, rel=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["--d_model", "63", "--h", "7"], "--pos sinusoidal needs an even --d_model"),
    (["--d_model", "72", "--h", "8", "--pos", "rope"], "--pos rope needs an even head width"),
    (["--keep_last", "0"], "--keep_last must be at least 1"),
    (["--seq_len", "10", "--min_len", "9"], "--min_len 9 is more than a translation can hold"),
    (["--bpe_dropout", "1"], "--bpe_dropout must lie in [0, 1)"),  # issue 43
    (["--bpe_dropout", "-0.1"], "--bpe_dropout must lie in [0, 1)"),
    (["--bpe_dropout", "0.1", "--tokenizer_type", "word"], "--bpe_dropout needs --tokenizer_type"),
    (["--keep_optimizer", "-1"], "--keep_optimizer must not be negative"),  # issue 45
    (["--lr_schedule", "linear"], "invalid choice: 'linear'"),
])
def test_shapes_and_values_the_model_cannot_use_are_one_line(argv, message, capsys):
    """10, 11. An odd width ended in a traceback; --keep_last 0 kept every checkpoint."""
    from nmt.cli import ArgumentParser
    with pytest.raises(SystemExit) as e:
        parse_config(argv, ArgumentParser(prog="train.py"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_bad_flag_in_code_is_one_line_naming_the_scripts_help():
    """parse_config without a parser (a notebook, a test, your code) raises a UserError of one
    line; "(see --help)" named no script to ask: it names train.py's."""
    from config import UserError
    with pytest.raises(UserError) as raised:
        parse_config(["--bogus", "1"])
    message = str(raised.value)
    assert "--bogus" in message and message.endswith("(see python train.py --help)")
    assert "\n" not in message


def test_help_lists_the_values_and_a_switch_needs_no_value(capsys):
    """14. --help did not list the values of --lr_schedule, --precision, --device; --compile
    alone was an error."""
    assert parse_config(["--compile"])[0].compile is True
    assert parse_config(["--compile", "false"])[0].compile is False
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for values in ("{constant,inverse_sqrt,cosine}", "{auto,fp32,bf16,fp16}",
                   "auto, cpu, cuda, cuda:N or mps"):
        assert values in text


def test_old_true_false_tie_embeddings_still_load():
    old = dataclasses.asdict(Config())
    for value, expected in ((True, "decoder"), (False, "none")):
        old["tie_embeddings"] = value
        assert Config.from_dict(old).tie_embeddings == expected
    legacy = {k: v for k, v in old.items() if k not in ("norm", "ffn", "pos", "n_kv_heads")}
    assert Config.from_dict(legacy).pos == "sinusoidal"  # options saved before they existed


def test_the_configuration_reference_is_generated_from_config_and_current():
    """docs/configuration.md is `python config.py`'s output: every field with its default and
    help, every preset; regenerate it when a field changes."""
    from conftest import ROOT

    from config import PRESETS, reference_markdown
    text = reference_markdown()
    for f in dataclasses.fields(Config):
        assert f"| `--{f.name}` | `{f.default!r}` |" in text, f.name
    assert all(f"| `{name}` |" in text for name in PRESETS)
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == text, \
        "docs/configuration.md is stale: python config.py > docs/configuration.md"


def test_every_preset_the_scripts_and_docs_name_exists():
    """Issue 41: train.py's docstring named `--preset multi30k_small` as the headline recipe;
    no such preset exists. Every `--preset NAME` in the scripts, the README and docs/ is one."""
    import re

    from conftest import ROOT

    from config import PRESETS
    files = [*ROOT.glob("*.py"), *ROOT.glob("nmt/*.py"), *ROOT.glob("dev/*.py"),
             ROOT / "README.md", *ROOT.glob("docs/*.md")]
    named = {(f.name, name) for f in files
             for line in f.read_text(encoding="utf-8").splitlines()
             if ".py" in line or "python" in line  # commands
             for name in re.findall(r"--preset[ =]+([a-z0-9_]+)\b", line)}
    assert {n for _, n in named} >= {"multi30k_modern", "multi30k_paper"}  # the search works
    assert [(f, n) for f, n in sorted(named) if n not in PRESETS] == []


# ---- the layout: the core at the top, the machinery in nmt/, the lab in dev/ --------------------

CORE = {"config", "model", "dataset", "train", "translate"}
SCRIPTS = {"train", "translate", "export", "compare"}


def project_imports():
    """{module: the project's modules it imports} for every module outside tests/ (imports
    inside functions counted), modules named as dotted paths from the root (nmt.decoding)."""
    import ast

    from conftest import ROOT
    files = [*ROOT.glob("*.py"), *ROOT.glob("nmt/*.py"), *ROOT.glob("dev/*.py")]
    modules = {".".join(f.relative_to(ROOT).with_suffix("").parts): f for f in files}
    graph = {}
    for name, f in modules.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_top_level_holds_the_core_and_the_user_scripts():
    """Issue 55: at most 10 .py files at the top (the card's five among them), the machinery in
    one flat folder nmt/, benchmarks and tools in dev/; imports run one way: scripts -> nmt/ ->
    the core -> config.py (the core never imports nmt/ or dev/: the folder is in no circle),
    and no module outside dev/ imports a script. Issue 63: nor dev/ (a script or the core
    importing it went unflagged), and config.py imports no module of the project."""
    import re

    from conftest import ROOT
    top = {f.stem for f in ROOT.glob("*.py")}
    assert len(top) <= 10 and CORE | {"export", "compare"} <= top, sorted(top)
    assert not [p for p in (ROOT / "nmt").iterdir() if p.is_dir() and p.name != "__pycache__"]
    # regular packages (issue 63): a namespace package loses to any nmt or dev on sys.path
    assert (ROOT / "nmt" / "__init__.py").is_file() and (ROOT / "dev" / "__init__.py").is_file()
    graph = project_imports()
    assert graph, "no module found"
    wrong = [(m, i) for m, imports in graph.items() for i in imports
             if (m in top and m not in SCRIPTS and i.startswith("nmt."))
             or (not m.startswith("dev.") and i in SCRIPTS)
             or (not m.startswith("dev.") and i.startswith("dev."))
             or (m == "config" and i != "config")]
    assert wrong == []
    # issue 63: those rules can tell (each kind of import they refuse, refused)
    rules_refuse = [("model", "nmt.decoding"), ("train", "dev.bench"), ("dataset", "dev.bench"),
                    ("nmt.runtime", "dev.bench"), ("config", "model"), ("nmt.files", "train")]
    assert all((m in top and m not in SCRIPTS and i.startswith("nmt."))
               or (not m.startswith("dev.") and i in SCRIPTS)
               or (not m.startswith("dev.") and i.startswith("dev."))
               or (m == "config" and i != "config") for m, i in rules_refuse)
    # the tests import dev/ only to test its tools
    users = sorted(f.name for f in (ROOT / "tests").glob("*.py")
                   if re.search(r"^\s*(from|import) dev\b", f.read_text(encoding="utf-8"), re.M))
    tools = {f"test_{f.stem}.py" for f in (ROOT / "dev").glob("*.py")} | {"test_bench.py"}
    assert "test_bench.py" in users and set(users) <= tools, users


def test_every_command_in_the_readme_and_docs_names_a_file_that_exists():
    """Every `python X.py` and `python -m package.module` in README.md and docs/ names a file
    of the repo (or pytest), so that each runs as written after the layout's move."""
    import re

    from conftest import ROOT
    missing, seen = [], 0
    for f in [ROOT / "README.md", *ROOT.glob("docs/*.md")]:
        text = f.read_text(encoding="utf-8")
        text = re.sub(r"\\?\n\s*", " ", text)  # a command wrapped across lines (issue 63, 12)
        for script in re.findall(r"python3? ([\w/]+\.py)\b", text):
            seen += 1
            if not (ROOT / script).is_file():
                missing.append((f.name, script))
        for module in re.findall(r"python3? -m ([\w.]+)", text):
            seen += 1
            if module != "pytest" and not (ROOT / (module.replace(".", "/") + ".py")).is_file():
                missing.append((f.name, module))
    assert seen > 100 and missing == []


def flags_of_commands(text: str) -> dict:
    """{script: {(--flag, the word after it)}} of each `python X.py`, `python -m dev.X` or
    `torchrun ... train.py` command in `text` (a notebook's `{PYTHON} X.py` too), and of each
    results table's `PRESET --flag ...` cell (train.py's); a `\\` continuation joins its lines."""
    import re

    command = re.compile(r"(?:(?:python3?|\{PYTHON\}) (?:-m (dev\.\w+)|(\w+\.py))"
                         r"|torchrun \S.*?(train\.py)"
                         r"|(?<=`)(?=(?:multi30k\w*|paper_\w+) --))"  # (a results table's cell:
                         r"([^`|;&#>)\n]*)")  # a preset, then train.py's flags)
    given = {}
    for m in command.finditer(re.sub(r"\\\n\s*", " ", text)):
        script = m.group(1).replace(".", "/") + ".py" if m.group(1) else \
            m.group(2) or m.group(3) or "train.py"
        for flag, value in re.findall(r"(?<![\w-])(--[A-Za-z][A-Za-z0-9_]*)(?:[ =]([^\s-]\S*))?",
                                      m.group(4)):  # (--N and --N_dec too)
            given.setdefault(script, set()).add((flag, value.strip("'\"")))
    return given


def flags_not_taken(given: dict) -> tuple[dict, int]:
    """({script: the --flags of `given` (flags_of_commands) not in the script's usage (its
    --help's first paragraph: the prose names flags too), and `--flag value` where the value is
    not one of the flag's choices}, how many values were checked against choices)."""
    import re

    from conftest import ROOT, run_here
    unknown, checked = {}, 0
    for script, flags in given.items():
        t = run_here(script, "--help", cwd=ROOT)
        assert t.returncode == 0, (script, t.stderr.decode())
        usage = t.stdout.decode().split("\n\n")[0]
        taken = set(re.findall(r"--[A-Za-z][A-Za-z0-9_]*", usage)) | {"--help"}  # (usage: -h)
        choices = {f: c.split(",")
                   for f, c in re.findall(r"(--[A-Za-z][A-Za-z0-9_]*) \{([^}]*)\}", usage)}
        for flag, value in sorted(flags):
            if flag not in taken:
                unknown.setdefault(script, []).append(flag)
            elif flag in choices and re.fullmatch(r"\w[\w.]*", value):  # (not $M, <...>, a|b)
                checked += 1
                if value not in choices[flag]:
                    unknown.setdefault(script, []).append(f"{flag} {value}")
    return unknown, checked


def test_every_flag_a_command_in_the_docs_gives_is_one_its_script_takes():
    """Every --flag of a `python X.py`, `python -m dev.X` or `torchrun ... train.py` command (or a
    results table's `PRESET --flag ...` cell, train.py's) in README.md, docs/, the notebooks,
    dev/'s shell scripts (the GPU's, run nowhere else) and the scripts' docstrings is in that
    script's usage (its --help), and a value given to a flag of choices is one of them: a flag
    or a choice renamed or removed in the code fails here until the pages follow (a user copying
    the command would meet "unrecognized arguments"). Each of those sources gives flags (a
    notebook's commands are `{PYTHON} X.py`)."""
    import ast
    import json

    from conftest import ROOT
    sources = {
        "README.md, docs/": [f.read_text(encoding="utf-8")
                             for f in [ROOT / "README.md", *ROOT.glob("docs/*.md")]],
        "dev/*.sh": [f.read_text(encoding="utf-8") for f in ROOT.glob("dev/*.sh")],
        "notebooks/": ["\n".join("".join(cell["source"]) for cell in json.loads(
            f.read_text(encoding="utf-8"))["cells"]) for f in ROOT.glob("notebooks/*.ipynb")],
        "docstrings": [ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")), clean=False)
                       or "" for f in [*ROOT.glob("*.py"), *ROOT.glob("dev/*.py"),
                                       *ROOT.glob("nmt/*.py")]]}
    given, found = {}, {}
    for source, texts in sources.items():
        for text in texts:
            for script, flags in flags_of_commands(text).items():
                given.setdefault(script, set()).update(flags)
                found[source] = found.get(source, 0) + len(flags)
    assert found.keys() == sources.keys(), found
    unknown, checked = flags_not_taken(given)
    assert len(given) >= 10 and sum(map(len, given.values())) > 100 and checked > 10
    assert unknown == {}


def test_the_docs_flag_check_finds_each_flag_and_choice_no_script_takes():
    """The check above on a page written wrong on purpose: in each kind of command it reads
    (a continuation line, a torchrun's, a results cell, a notebook's `{PYTHON}`), a flag that is
    not a script's (`--input`: named in compare.py's help prose, not in its usage; `--N_enc`:
    capitals) and a value not among a flag's choices (`bf16.5`: a dot), beside right ones."""
    page = """```bash
python translate.py $M --beam 4 --bream 4 --attention_view sideways "Hello."
python -m dev.bench --stepz 3 --preset multi30k
python compare.py a.hyp b.hyp --reference ref --input src
torchrun --nproc_per_node 2 train.py --preset paper_base --N_enc 6 \\
    --precision bf16.5
```
| `paper_big --warmupp 4000 --N 6` | 28.4 |
sh(f"{PYTHON} export.py --model_folder {MODEL} --quantization int9")
"""
    assert flags_not_taken(flags_of_commands(page))[0] == {
        "translate.py": ["--attention_view sideways", "--bream"], "dev/bench.py": ["--stepz"],
        "compare.py": ["--input"], "train.py": ["--N_enc", "--precision bf16.5", "--warmupp"],
        "export.py": ["--quantization int9"]}


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation but `-` and `_`
    dropped, spaces made `-`, a repeated one numbered (`-1`, `-2`); code blocks skipped."""
    import re

    anchors, counts = set(), {}
    for line in re.sub(r"```.*?```", "", markdown, flags=re.S).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
            counts[slug] = counts.get(slug, 0) + 1
    return anchors


def test_every_relative_link_and_anchor_in_the_readme_and_docs_resolves():
    """A link `[..](docs/x.md#heading)` in README.md, docs/ or the notebooks names a file of the
    repo and, with an anchor into a markdown file, one of its headings: a heading reworded, or a
    page moved, breaks it on GitHub without a word."""
    import re

    from conftest import ROOT
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("notebooks/*.ipynb")]
    broken, seen = [], 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            seen += 1
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in github_anchors(
                    file.read_text(encoding="utf-8")):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert seen > 50 and broken == []
    assert github_anchors("# A `b` c\n## What's new?\n```\n# no\n```\n## What's new?") == {
        "a-b-c", "whats-new", "whats-new-1"}


def test_module_paths_in_prose_name_the_modules_where_they_live():
    """Issue 63, 12: after the layout's move, docstrings, comments and docs still named
    `checkpoint.average_checkpoints`, `runtime.setup_device`... (now nmt.checkpoint, ...). A
    name `X.f` where X is a module of nmt/ that defines f must be written nmt.X.f, but in code
    of a file that imports X itself (from nmt import X). dev/LOG.md is a dated history: left."""
    import ast
    import re

    from conftest import ROOT
    defined = {}
    for f in (ROOT / "nmt").glob("*.py"):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        defined[f.stem] = {n.name for n in tree.body
                           if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    pattern = re.compile(r"(?<![\w./])(" + "|".join(defined) + r")\.(\w+)")
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"),
             *ROOT.glob("nmt/*.py"), *ROOT.glob("dev/*.py")]
    stale = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        imported = set(re.findall(r"from nmt import (\w+)", text))
        for module, name in pattern.findall(text):
            if name in defined[module] and module not in imported:
                stale.append((f.name, f"{module}.{name}"))
    assert stale == []


def test_the_dev_tools_name_themselves_as_they_are_run():
    """Issue 63, 12: a dev tool's usage and errors said `bench.py`, where the command is
    `python -m dev.bench`."""
    from conftest import ROOT, run_here
    for tool in dev_tools():
        t = run_here(f"dev/{tool}.py", "--help", cwd=ROOT)
        assert t.stdout.decode().startswith(f"usage: python -m dev.{tool} "), tool


def dev_tools():
    """The modules of dev/ a user runs (python -m dev.NAME), not the helpers they share."""
    from conftest import ROOT
    return sorted(f.stem for f in (ROOT / "dev").glob("*.py")
                  if 'if __name__ == "__main__":' in f.read_text(encoding="utf-8"))


def test_the_tools_in_dev_run_from_the_root():
    """`python -m dev.NAME --help` works from the repo's root for every tool in dev/: one as a
    fresh process (the module path itself), each in this process (its parser)."""
    import subprocess
    import sys

    from conftest import ROOT, run_here
    tools = dev_tools()
    assert {"bench", "bench_decode", "bench_loss", "plot_runs"} <= set(tools)
    proc = subprocess.run([sys.executable, "-m", "dev.bench_loss", "--help"], cwd=ROOT,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and b"usage:" in proc.stdout, proc.stderr.decode()[-800:]
    for tool in tools:
        t = run_here(f"dev/{tool}.py", "--help", cwd=ROOT)
        assert t.returncode == 0 and b"usage:" in t.stdout, (tool, t.stderr.decode()[-800:])


def message_patterns():
    """A regular expression for every string the project's code can build (its modules and
    scripts), with the length of its literal text: literal parts escaped, each placeholder or
    call a quote's `…` (\x00) or a short value without spaces (`mps`, the `s` of a plural):
    never words of the quote (issue 70: any text passed, a reworded message too), a
    conditional either branch."""
    import ast
    import re

    from conftest import ROOT

    def pattern(node):  # (regex, literal characters)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return re.escape(node.value), len(node.value)
        if isinstance(node, ast.JoinedStr):
            parts = [pattern(v) for v in node.values]
            return "".join(p for p, _ in parts), sum(n for _, n in parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            (a, m), (b, n) = pattern(node.left), pattern(node.right)
            return a + b, m + n
        if isinstance(node, ast.FormattedValue) and isinstance(node.value, ast.IfExp):
            return pattern(node.value)  # {'a' if x else ''}: either branch, as written
        if isinstance(node, ast.IfExp):
            (a, m), (b, n) = pattern(node.body), pattern(node.orelse)
            return f"(?:{a}|{b})", max(m, n)
        return r"(?:\x00|[^\s\x00]{0,12})", 0  # a placeholder, a call, a name
    found = []
    for f in [*ROOT.glob("*.py"), *ROOT.glob("nmt/*.py")]:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.JoinedStr, ast.BinOp)) or (
                    isinstance(node, ast.Constant) and isinstance(node.value, str)):
                text, literal = pattern(node)
                if literal >= 20:
                    found.append((re.compile(text, re.S), literal))
    return found


def test_every_message_the_troubleshooting_page_quotes_is_still_printed():
    """Issue 64: docs/troubleshooting.md quotes the exact lines the repo prints (`…` for what
    varies); each must still be a whole line some string of the code builds (its prefix
    "train.py: error: " is run_main's), its own words at least 80% of the quote: a message
    reworded in the code fails here until the page follows. Issue 70: a placeholder stands for
    the quote's `…` or a value, never for its words; the MPS line is the one train.py prints
    (on a machine without MPS: every machine the tests have run on)."""
    import re

    import torch

    from conftest import ROOT, run_here
    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    quoted = re.findall(r"```text\n(.*?)\n```", page, re.S)
    assert len(quoted) >= 10
    patterns = message_patterns()

    def printed(line):
        line = re.sub(r"^\w+\.py: error: ", "", line)
        words = len(line.replace("…", ""))
        return any(p.fullmatch(line.replace("…", "\x00")) and n >= 0.8 * words
                   for p, n in patterns)
    assert [q for q in quoted if not printed(q)] == []
    assert not printed("--device mps: MPS is not available on this machinery")  # it can tell
    oom = next(q for q in quoted if "out of memory on … in a step" in q)
    assert not printed(oom.replace("on … in a step", "on your GPU in a step"))  # words: no value
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        t = run_here("train.py", "--device", "mps", "--data_dir", "nowhere", cwd=ROOT)
        mps = next(q for q in quoted if q.startswith("--device mps"))
        assert t.returncode == 2 and t.stderr.decode() == f"train.py: error: {mps}\n"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/troubleshooting.md" in readme


def test_the_docs_name_measurements_not_issues_and_multi30k_files_as_they_are():
    """Issue 70, 8: docs cited issue numbers, reviews and sessions where they should name the
    measurement and its machine (those are the lab's: dev/LOG.md); compare.py's docstring named
    `tok/test.lc.norm.tok.de`, a file Multi30k does not have (test_2016_flickr.lc.norm.tok.de)."""
    import re

    from conftest import ROOT
    cited = [(f.name, m.group(0)) for f in [ROOT / "README.md", *ROOT.glob("docs/*.md")]
             for m in re.finditer(r"(?i)\bissue'?s? \d+|\bissue's\b|review session|"
                                  r"\bthis session\b|'s review\b", f.read_text(encoding="utf-8"))]
    assert cited == []
    splits = r"(train|val|test_2016_flickr|test_2017_flickr|test_2017_mscoco|test_2018_flickr)"
    named = [(f.name, name) for f in [ROOT / "README.md", *ROOT.glob("docs/*.md"),
                                      *ROOT.glob("*.py"), *ROOT.glob("nmt/*.py")]
             for name in re.findall(r"tok/([\w.]+\.lc\.norm\.tok\.\w\w)\b",
                                    f.read_text(encoding="utf-8"))]
    assert named and [n for n in named if not re.fullmatch(splits + r"\.lc\.norm\.tok\.\w\w",
                                                           n[1])] == []


def test_the_pages_keep_their_paragraphs_and_name_the_machine_of_a_figure():
    """docs/troubleshooting.md's out-of-memory advice and the memory a step takes are two
    paragraphs (they had been joined in one line); docs/scaling.md's compile times name their
    CPU and runs, not "this 2-core CPU"."""
    from conftest import ROOT
    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert "`--model_folder`.\n\nWhat a step of each shape takes" in page
    scaling = " ".join((ROOT / "docs" / "scaling.md").read_text(encoding="utf-8").split())
    figure = scaling[scaling.index("70 s against 53 s"):][:250]
    assert ("one run each, on an AMD EPYC with AVX512-BF16, 2 cores shared with a training run, "
            "torch 2.13.0 CPU") in figure


@pytest.mark.parametrize("name", [
    "batch_size", "max_tokens", "warmup", "max_steps", "save_every", "keep_last", "keep_epochs",
    "keep_optimizer", "val_max_sentences", "val_examples", "num_workers", "clip_grad", "patience",
    "eval_every", "tokenizer_sample", "fixed_shapes", "time_budget", "max_len_a", "max_len_b",
    "min_len", "N_dec", "threads"])
def test_every_count_refuses_a_negative_value(name):
    """Config.negative, validate's rule and translate.py's check before a model is loaded: each
    of these settings is refused below 0, and only where asked about (names given)."""
    config = Config(**{name: -1})
    message = f"--{name} must not be negative (got -1)"
    assert config.negative() == message and config.validate() == message
    assert config.negative({name}) == message and config.negative({"d_model"}) is None


def test_the_peak_learning_rate_follows_the_model_width():
    """--lr 0 (the default) is LR_AT_512 · 512 / d_model, as --help says (4e-3 at d_model 128,
    the Multi30k presets' width); a --lr given is used as it is."""
    assert Config().peak_lr() == pytest.approx(1e-3)
    assert Config(d_model=128).peak_lr() == pytest.approx(4e-3)
    assert Config(d_model=128, lr=5e-4).peak_lr() == 5e-4


@pytest.mark.parametrize("settings, message", [
    ({"N": 0}, "--N must be positive (got 0)"),
    ({"max_bad_steps": 0}, "--max_bad_steps must be positive (got 0)"),
    ({"seq_len": 2, "min_len": 0}, "--seq_len must be at least 3"),
    ({"max_len_a": 0, "max_len_b": 0, "min_len": 0}, "--max_len_a 0 and --max_len_b 0 leave no "
                                                      "room for an output token"),
    ({"h": 8, "n_kv_heads": 3}, "--h (8) must be divisible by --n_kv_heads (3)"),
    ({"tie_embeddings": "all"}, "--tie_embeddings all needs --shared_vocab true"),
    ({"attention_dropout": 1.0}, "--attention_dropout must be in [0, 1), got 1.0"),
    ({"label_smoothing": 1.0}, "--label_smoothing must be in [0, 1), got 1.0"),
    ({"lr": -0.5}, "--lr must not be negative"),
    ({"device": "cuda:"}, "--device must be auto, cpu, cuda, cuda:N or mps, got 'cuda:'"),
    ({"lang_src": ""}, "--lang_src and --lang_tgt must be two different languages"),
    ({"tokenizer_file": "tokenizer.json"}, "--tokenizer_file must contain {0}"),
    ({"val_fraction": 0.0}, "--val_fraction must be in (0, 1), got 0.0"),
    ({"upsample": 2}, "--extra_tag and --upsample go with --extra_data_dir"),
    ({"max_len_ratio": 0.99}, "--max_len_ratio must be 0 (off) or at least 1 (got 0.99)"),
    ({"max_len_ratio": -1.0}, "--max_len_ratio must be 0 (off) or at least 1"),
    ({"distill_from": "teacher", "distill_average": 0},
     "--distill_beam and --distill_average must be at least 1"),
    ({"bpe_dropout": 0.1, "fixed_shapes": 4}, "--fixed_shapes does not go with --bpe_dropout"),
    ({"cuda_graphs": True}, "--cuda_graphs goes with --compile true"),
])
def test_each_rule_of_validate_refuses_at_its_edge(settings, message):
    """Each refusal of Config.validate at the first value it refuses (a zero where a count
    must be positive, a rate of exactly 1, an option without the one it needs): a rule
    loosened by one, or dropped, lets a run start that fails later or trains wrong."""
    problem = Config(**settings).validate()
    assert problem is not None and message in problem, problem


@pytest.mark.parametrize("settings", [
    {"seq_len": 10, "min_len": 8},  # the most output tokens seq_len leaves
    {"max_tokens": 350},  # a batch of one sequence of --seq_len (350) tokens
    {"max_len_a": 0, "max_len_b": 1, "min_len": 1},
    {"min_len": 20},  # above 1.2 + 10 (a one-token source's limit, which it raises): refused
    {"max_len_a": 0.5, "max_len_b": 0.5, "min_len": 0},
    {"seq_len": 3, "min_len": 1},
    {"h": 8, "n_kv_heads": 4},
    {"tie_embeddings": "all", "shared_vocab": True},
    {"device": "cuda:1"},
    {"extra_data_dir": "bt", "upsample": 2},
    {"max_len_ratio": 1.0},
])
def test_validate_accepts_the_values_at_each_edge(settings):
    """The last value each rule lets through is accepted (a boundary moved by one refuses a
    setting --help allows)."""
    assert Config(**settings).validate() is None


def test_warmup_is_refused_only_with_a_constant_rate():
    """--warmup with the default inverse_sqrt schedule (or cosine) is used; only beside
    --lr_schedule constant, which has none, is it refused."""
    assert parse_config(["--warmup", "100"])[0].warmup == 100
    assert parse_config(["--lr_schedule", "cosine", "--warmup", "100"])[0].warmup == 100
    from config import UserError
    with pytest.raises(UserError, match="--warmup with --lr_schedule constant"):
        parse_config(["--lr_schedule", "constant", "--warmup", "100"])


def test_a_switch_takes_every_spelling_of_true_and_false():
    """--compile yes/on/1/true and no/off/0/false, as --help's [true|false] reads; anything
    else is refused."""
    for word, value in (("yes", True), ("on", True), ("1", True), ("TRUE", True),
                        ("no", False), ("off", False), ("0", False), ("False", False)):
        assert parse_config(["--compile", word])[0].compile is value, word
    from config import UserError
    with pytest.raises(UserError, match="expected true or false, got 'maybe'"):
        parse_config(["--compile", "maybe"])


def test_datasource_typed_on_a_resume_of_a_local_corpus_is_refused():
    """The run's settings (a resume's checkpoint, `settings`) read --data_dir's files: a
    --datasource typed beside them would do nothing, and is refused though --data_dir was
    not typed this time."""
    from config import UserError

    def resumed(config, given):  # a checkpoint trained on local files
        return dataclasses.replace(config, data_dir="corpus")
    with pytest.raises(UserError, match="--datasource with --data_dir: the run reads the files "
                                        "of --data_dir corpus"):
        parse_config(["--datasource", "x/y"], settings=resumed)
    assert parse_config(["--lr", "1e-3"], settings=resumed)[0].lr == 1e-3


def test_translate_refuses_a_batch_size_or_an_average_below_one():
    """checkpoint_config (translate.py's and export.py's flags): --batch_size 0 and --average 0
    are one line before any model is loaded (a 0 would fall back to the default silently)."""
    from config import RaisingParser, UserError, add_locating_arguments, checkpoint_config
    for argv, message in ((["--batch_size", "0"], "--batch_size must be positive (got 0)"),
                          (["--average", "0"], "--average must be positive (got 0)")):
        parser = RaisingParser()
        add_locating_arguments(parser)
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            checkpoint_config(parser, parser.parse_args(argv))
    parser = RaisingParser()
    add_locating_arguments(parser)
    config, given = checkpoint_config(parser, parser.parse_args(["--batch_size", "1"]))
    assert config.batch_size == 1 and given == {"batch_size"}


def test_a_newer_checkpoints_unknown_settings_are_dropped():
    """A checkpoint saved by newer code holds settings this code has not: Config.from_dict
    drops them (a TypeError would make it unloadable) and keeps every known one."""
    saved = {**Config(d_model=64, h=4).to_dict(), "a_future_setting": 3}
    config = Config.from_dict(saved)
    assert (config.d_model, config.h) == (64, 4) and not hasattr(config, "a_future_setting")
