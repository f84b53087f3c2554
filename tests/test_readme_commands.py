"""Every command in README.md's code blocks runs as a newcomer would type it.

pretrain_gpt.py commands (python or torchrun) run as a dry run with torchrun's world size, which checks
every flag and layout rule without training; launch scripts run with DRY_RUN=1 (scripts/launch.sh). The
tools run for real, in README order where one needs another's output, on a small corpus and a model of a
few iterations, with flags appended (argparse keeps the last) where the README's sizes take minutes
(SHRINK). Flag fragments (`--data-path ...` lines) must parse, and the Python snippets run. A command no
rule covers fails the test, so a new README command needs a rule here.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from megalite.arguments import parse_args
from megalite.plan.dry_run import dry_run
from megalite.run.training import pretrain
from tests.helpers.corpus import make_texts, write_jsonl
from tools.fork_ranks import cpu_world_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")

# Commands not run here, by their first word (or two), and why.
SKIPS = {
    "pip": "installs packages from the network; the suite runs in the environment it would make",
    "python -m": "`python -m pytest` is the suite this test belongs to",
    "sbatch": "needs a SLURM cluster",
    "wandb": "uploads a run to Weights & Biases: needs the network and an account",
}
PLACEHOLDERS = {"...", "<the", "printed", "model", "flags>"}  # README's "fill in" marks, dropped
# Flags appended to a tool's README command so that it runs in seconds: same code path, tiny sizes.
SHRINK = {
    "tools/train_tokenizer.py": ["--vocab-size", "350"],  # 32000 needs a corpus of megabytes
    "tools/check_layouts.py": ["--layouts", "tp2", "--models", "llama", "--train-iters", "2"],
    "tools/check_compositions.py": ["--list"],  # tests/test_compositions.py trains the matrix by this command
    "tools/check_resharding.py": ["--targets", "tp1-pp1-dp1", "--train-iters", "3", "--stop-at", "2"],
    "tools/fault_campaign.py": ["--trials", "1"],
}
# Tools run in this order (each may need an earlier one's output); any tool not listed fails the test.
TOOL_ORDER = ["data/build_builtin_corpus.py", "tools/train_tokenizer.py", "tools/preprocess_data.py",
              "tools/merge_datasets.py", "tools/generate.py", "tools/convert_checkpoint.py", "tools/loss_compare.py",
              "tools/plot_metrics.py", "tools/bench/pipeline.py", "tools/check_layouts.py",
              "tools/check_compositions.py", "tools/check_resharding.py", "tools/fault_campaign.py"]
# The Python snippets, by a word in each, and the tool whose output each reads.
SNIPPETS = {"build_gpt_datasets": "tools/merge_datasets.py", "AutoModelForCausalLM": "tools/convert_checkpoint.py"}


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", open(README, encoding="utf-8").read(), re.S)


def readme_commands() -> list[list[str]]:
    """Each bash command as words: continuation lines joined, comments dropped, `a && b` split in two."""
    commands = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = [word for word in shlex.split(line, comments=True) if word not in PLACEHOLDERS]
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:end])
                words = words[end + 1:]
    return commands


def split_environment(words: list[str]) -> tuple[dict, list[str]]:
    """(`NAME=value` words before the command, the command)."""
    count = next(i for i, word in enumerate(words) if "=" not in word)
    return dict(word.split("=", 1) for word in words[:count]), words[count:]


def kind(words: list[str]) -> str:
    """"skip", "fragment" (flags only), "pretrain" (a dry run), "script" (DRY_RUN=1) or "tool"."""
    _, words = split_environment(words)
    if words[0] in SKIPS or " ".join(words[:2]) in SKIPS:
        return "skip"
    if words[0].startswith("--"):
        return "fragment"
    if "pretrain_gpt.py" in words:
        return "pretrain"
    if words[0].startswith("scripts/"):
        return "script"
    if words[0] == "python" and words[1] in TOOL_ORDER:
        return "tool"
    raise AssertionError(f"no rule for the README command {shlex.join(words)!r}: add one to {__file__}")


def commands_of(name: str) -> list[list[str]]:
    return [words for words in readme_commands() if kind(words) == name]


def test_every_readme_command_has_a_rule_and_the_two_first_commands_are_kept():
    commands = readme_commands()
    assert len(commands) > 20 and all(kind(words) for words in commands)
    assert all(any(marker in block for marker in SNIPPETS) for block in readme_blocks("python"))
    # A CPU-only machine's torch wheel, then the two commands: the default run and the suite.
    pinned = next(line.strip() for line in open(os.path.join(REPO_ROOT, "requirements.txt")) if line.startswith("torch"))
    assert commands[0][:3] == ["pip", "install", pinned] and "download.pytorch.org/whl/cpu" in commands[0][-1]
    assert commands[1:5] == [["pip", "install", "-r", "requirements.txt"], ["python", "pretrain_gpt.py"],
                             ["pip", "install", "-r", "requirements.txt"], ["python", "-m", "pytest"]]


OUTPUT_FLAGS = ("--save", "--output-prefix", "--out")  # where README commands write


def test_what_readme_commands_write_is_git_ignored():
    """A newcomer who runs the README's commands in the checkout must not see their outputs as changes."""
    outputs = {words[i + 1] for words in readme_commands() for i, word in enumerate(words[:-1])
               if word in OUTPUT_FLAGS and not words[i + 1].isupper()}  # DIR, PATH: placeholders
    assert {"runs/lr3e-3", "ckpt/llama", "hf/default", "tokenizers/my", "curves.png"} <= outputs
    paths = [path + suffix for path in outputs
             for suffix in ((".bin", ".idx") if path.startswith("data/") else ("/x",) if "." not in path else ("",))]
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO_ROOT, ".git")):
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *paths], capture_output=True, text=True,
                             cwd=REPO_ROOT).stdout.split()
    assert sorted(set(paths) - set(ignored)) == []


@pytest.mark.parametrize("words", commands_of("pretrain"), ids=shlex.join)
def test_pretrain_commands_pass_a_dry_run(words, capsys):
    launcher = words[:words.index("pretrain_gpt.py")]
    world_size = int(launcher[launcher.index("--nproc_per_node") + 1]) if "torchrun" in launcher else 1
    flags = words[words.index("pretrain_gpt.py") + 1:]
    report = dry_run(parse_args([*flags, "--dry-run", "--world-size", str(world_size)]))
    assert report.run.parallel.world_size == world_size and "dry run:" in capsys.readouterr().out


# The flags of the README's data fragments today: the test must not pass on a README without them.
FRAGMENT_FLAGS = {"--data-path", "--split", "--train-data-path", "--valid-data-path"}


def test_flag_fragments_parse():
    fragments = commands_of("fragment")
    assert len(fragments) >= 3 and FRAGMENT_FLAGS <= {word for words in fragments for word in words}, fragments
    for words in fragments:
        parse_args([*words, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--dry-run"])


@pytest.mark.parametrize("words", commands_of("script"), ids=shlex.join)
def test_launch_scripts_pass_a_dry_run(words, tmp_path):
    environment, words = split_environment(words)
    result = subprocess.run([os.path.join(REPO_ROOT, words[0]), *words[1:]], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300, env={**os.environ, **environment, "DRY_RUN": "1",
                                                            "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "largest total per rank" in result.stdout


def _prepare(tmp_path, tool: str) -> None:
    """The files a tool's README command reads that no earlier README command writes."""
    if tool == "tools/train_tokenizer.py":
        os.makedirs(tmp_path / "corpus")
        write_jsonl(tmp_path / "corpus" / "code.jsonl", [{"text": text} for text in make_texts(150)])
    elif tool == "tools/merge_datasets.py":
        for name in ("a", "b"):
            for suffix in (".bin", ".idx"):
                shutil.copy(tmp_path / "data" / f"my_text_document{suffix}",
                            tmp_path / "data" / f"{name}_text_document{suffix}")
    elif tool == "tools/generate.py":  # the default run's checkpoint, of a model of a few iterations
        pretrain(parse_args(["--data-path", str(tmp_path / "data/my_text_document"), "--tokenizer-type",
                             "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "tokenizers/my.model"),
                             "--num-layers", "1", "--hidden-size", "32", "--seq-length", "64", "--train-iters", "4",
                             "--max-position-embeddings", "2048",  # from-hf's --seq-length 2048
                             "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
                             "--eval-interval", "0", "--eval-iters", "0", "--save", str(tmp_path / "runs/default")]),
                 log=lambda line: None)
        for run in ("a", "b", "lr1e-3", "lr3e-3"):  # tools/loss_compare.py and tools/plot_metrics.py compare runs
            os.makedirs(tmp_path / "runs" / run)
            shutil.copy(tmp_path / "runs/default/metrics.jsonl", tmp_path / "runs" / run)


def _run(words: list[str], cwd) -> subprocess.CompletedProcess:
    tool = words[1]
    command = [sys.executable, os.path.join(REPO_ROOT, tool), *words[2:], *SHRINK.get(tool, [])]
    if tool == "data/build_builtin_corpus.py":  # in this test's folder, from a few files, not the shared build
        command += ["--build-dir", str(cwd / "build"), "--max-files", "20"]
    if words[2:3] == ["from-hf"]:
        shutil.copytree(cwd / "hf/default", cwd / "hf/llama", dirs_exist_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=600,
                            env=cpu_world_environment(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, f"{shlex.join(words)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_tools_and_snippets_run(tmp_path):
    tools = commands_of("tool")
    assert {words[1] for words in tools} == set(TOOL_ORDER)
    for tool in TOOL_ORDER:
        _prepare(tmp_path, tool)
        for words in [words for words in tools if words[1] == tool]:
            _run(words, tmp_path)
        for marker in [marker for marker, after in SNIPPETS.items() if after == tool]:
            _run_snippets(tmp_path, marker)
    assert (tmp_path / "curves.png").exists() and (tmp_path / "ckpt/llama").is_dir()


def _run_snippets(cwd, marker: str) -> None:
    snippets = [block for block in readme_blocks("python") if marker in block]
    assert snippets, marker
    for snippet in snippets:
        result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=cwd,
                                timeout=300, env=cpu_world_environment(OMP_NUM_THREADS="1"))
        assert result.returncode == 0, f"{snippet}\n{result.stderr[-3000:]}"
