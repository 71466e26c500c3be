"""README.md's examples are what the commands print today (scripts/make_docs.py), and
the tiny checkpoint of its CPU walkthrough is what scripts/make_tiny_checkpoint.py makes.

The README is rendered once (test_readme_examples_are_current): that runs the CPU
walkthrough (build, convert, run, serve, curl, the openai client) end to end. The other
tests hold the generator's rules on small examples of their own."""

from __future__ import annotations

import functools
import importlib.util
import json
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-qwen3"
# The walkthrough's prompts: a completion's text and two chat messages (README.md).
WALKTHROUGH_PROMPT = "The cat sat on the mat."
WALKTHROUGH_CHATS = ["Tell me a story.", "Hello, how are you?"]


@functools.cache
def _script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_examples_are_current() -> None:
    make_docs = _script("make_docs")
    readme = (REPO / "README.md").read_text()
    blocks = make_docs.BLOCK.findall(readme)
    assert len(blocks) >= 3
    assert any(session == "tiny" for _, session, *_ in blocks), "the CPU walkthrough is gone"
    assert make_docs.render(readme) == readme, "README.md is stale: run `make docs`"


def test_the_readme_states_the_calibration_as_recorded() -> None:
    """The README's account of the cost model's calibration is the summary every report
    states (calibration.RECORDED), not figures of an older calibration."""
    from mkgen.plan.calibration import RECORDED

    readme = " ".join((REPO / "README.md").read_text().split())
    assert RECORDED.describe() in readme


def test_an_example_block_is_rewritten_with_masked_build_time() -> None:
    make_docs = _script("make_docs")
    stale = "intro\n<!-- mkgen-example: mkgen --version -->\nold text\n<!-- /mkgen-example -->\n"
    fresh = make_docs.render(stale)
    assert fresh.startswith("intro\n<!-- mkgen-example: mkgen --version -->\n```\n$ mkgen")
    assert "old text" not in fresh and "mkgen, version" in fresh
    assert make_docs.render(fresh) == fresh
    assert make_docs.mask("wrote b/ in 12.3 s: x") == "wrote b/ in ... s: x"


def test_run_dependent_figures_are_masked() -> None:
    """Seconds of a run, a response's id and timestamp; token ids and ms/step stay."""
    make_docs = _script("make_docs")
    run = "b: set-up and prefill 0.7 s; 1 kernel call(s) in 9.4 s (TPU interpret mode)"
    assert make_docs.mask(run) == "b: set-up and prefill ... s; 1 kernel call(s) in ... s (TPU interpret mode)"  # fmt: skip
    response = '{"id": "chatcmpl-1b19637a", "created": 1796307372, "token_ids": [28, 101]}'
    assert make_docs.mask(response) == '{"id": "chatcmpl-...", "created": ..., "token_ids": [28, 101]}'  # fmt: skip
    kept = "predicted 0.970 ms/step, 12 files"
    assert make_docs.mask(kept) == kept


def test_a_failing_example_stops_the_generator() -> None:
    make_docs = _script("make_docs")
    with pytest.raises(RuntimeError, match="mkgen show no-such-spec"):
        make_docs.render("<!-- mkgen-example: mkgen show no-such-spec -->\n<!-- /mkgen-example -->")


def _examples(*commands: str, session: str | None = "s") -> str:
    prefix = f"mkgen-example {session}" if session else "mkgen-example"
    return "".join(f"<!-- {prefix}: {c} -->\n<!-- /mkgen-example -->\n" for c in commands)


def test_a_session_runs_its_examples_in_order_in_one_directory() -> None:
    """A session's examples see each other's files (a shell, a heredoc, a pipe); an
    example outside it starts in an empty directory holding only examples/."""
    make_docs = _script("make_docs")
    heredoc = "cat > note.txt <<'EOF'\nmade here\nEOF"
    fresh = make_docs.render(_examples(heredoc, "cat note.txt | tr a-z A-Z", "ls"))
    assert "$ cat note.txt | tr a-z A-Z\nMADE HERE\n```" in fresh
    assert "$ ls\nexamples\nnote.txt\n```" in fresh
    assert f"$ {heredoc}\n```" in fresh  # the command as typed, nothing printed
    with pytest.raises(RuntimeError, match="cat note.txt"):
        make_docs.render(_examples(heredoc) + _examples("cat note.txt", session=None))


def test_a_server_example_refuses_a_taken_port_before_starting() -> None:
    make_docs = _script("make_docs")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} is taken"):
            make_docs.render(_examples(f"mkgen serve no-build --port {port} &"))


def test_only_a_server_runs_in_the_background_and_a_kill_needs_its_job() -> None:
    make_docs = _script("make_docs")
    with pytest.raises(ValueError, match="only `mkgen serve ... &`"):
        make_docs.render(_examples("sleep 30 &"))
    with pytest.raises(RuntimeError, match="'kill %1': no such job running"):
        make_docs.render(_examples("kill %1"))


def test_a_session_left_with_its_server_running_is_an_error(tmp_path: Path) -> None:
    """The README must stop what it starts: a job still running when the examples end
    is named, and stopped."""
    make_docs = _script("make_docs")
    with ExitStack() as stack:
        examples = make_docs.Examples(stack)
        session = examples.session("walk")
        process = subprocess.Popen(["sleep", "60"])
        lock = (tmp_path / "lock").open("w")
        session.jobs.append(make_docs.Job("mkgen serve b &", process, tmp_path / "log", lock))
        with pytest.raises(RuntimeError, match=r"session 'walk' ends with job %1 .*kill %1"):
            examples.check_all_stopped()
    assert process.poll() is not None and lock.closed


def test_the_tiny_checkpoint_is_what_its_script_makes(tmp_path: Path) -> None:
    """examples/tiny-qwen3 byte for byte (the script is deterministic), its vocabulary
    the config's, the chat template's markers and the eos one id each, under 1 MB."""
    from tokenizers import Tokenizer

    make_tiny = _script("make_tiny_checkpoint")
    make_tiny.write(tmp_path)
    for made in tmp_path.iterdir():
        assert (TINY / made.name).read_bytes() == made.read_bytes(), made.name
    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    config = json.loads((TINY / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    eos = json.loads((TINY / "tokenizer_config.json").read_text())["eos_token"]
    assert tokenizer.token_to_id(eos) == config["eos_token_id"]
    chat = tokenizer.encode(make_tiny.chat_prompt(TINY, "Hi")).tokens
    assert chat[0] == "<|im_start|>" and chat.count("<|im_end|>") == 1
    assert tokenizer.decode(tokenizer.encode(WALKTHROUGH_PROMPT).ids) == WALKTHROUGH_PROMPT.lower()
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2**20


def test_the_walkthrough_greedy_tokens_lead_by_a_margin() -> None:
    """Every greedy step of the walkthrough's prompts leads the runner-up by MIN_LEAD in
    the reference's logits, so the README's tokens do not depend on the CPU."""
    make_tiny = _script("make_tiny_checkpoint")
    readme = (REPO / "README.md").read_text()
    for text in (WALKTHROUGH_PROMPT, *WALKTHROUGH_CHATS):
        assert f'"{text}"' in readme, f"the walkthrough no longer sends {text!r}"
    texts = [WALKTHROUGH_PROMPT, *(make_tiny.chat_prompt(TINY, m) for m in WALKTHROUGH_CHATS)]
    for text, (ids, lead) in zip(texts, make_tiny.greedy_leads(TINY, texts, 8), strict=True):
        assert lead >= make_tiny.MIN_LEAD, (text, ids, lead)
