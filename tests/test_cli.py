"""``clef-gguf`` as a user runs it: a real subprocess, JSON on stdout, exit codes."""

import json
import shutil
import subprocess
import sys

import pytest

from clef_gguf.cli import COMMANDS

REQUEST = {"state": "The invoice is 40 days overdue.",
           "questions": {"overdue": {"type": "noul", "instructions": "Is it overdue?"},
                         "action": {"type": "choice", "criteria": {"remind": None, "wait": None}}}}


def clef_gguf(*args, stdin=None, timeout=300):
    exe = shutil.which("clef-gguf")
    cmd = [exe] if exe else [sys.executable, "-m", "clef_gguf.cli"]
    return subprocess.run([*cmd, *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_decide_from_file(tiny_model_dir, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(REQUEST))
    proc = clef_gguf("decide", "--model", tiny_model_dir, "--request", req, "--timings")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["answers"]) == {"overdue", "action"}
    assert "timings_ms" in proc.stderr


def test_decide_from_stdin_with_truncation(tiny_model_dir):
    body = {**REQUEST, "state": "late " * 3000}
    proc = clef_gguf("decide", "-m", tiny_model_dir, "--max-length", 1024, "--truncate-state",
                     stdin=json.dumps(body))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["truncated"] is True


@pytest.mark.parametrize("body, code, field", [
    ({"state": "x", "questions": {"q": {"type": "maybe"}}}, "invalid_question_type", "questions.q.type"),
    ({"questions": {"q": {"type": "noul"}}}, "missing_field", "state"),
    ("{not json", "invalid_json", None),
])
def test_invalid_request_exits_2_with_error_json(tiny_model_dir, body, code, field):
    stdin = body if isinstance(body, str) else json.dumps(body)
    proc = clef_gguf("decide", "--model", tiny_model_dir, stdin=stdin)
    assert proc.returncode == 2
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == code and err["field"] == field and err["message"]
    assert "Traceback" not in proc.stderr


def test_strict_flag_refuses_what_is_otherwise_a_warning(tiny_model_dir):
    body = json.dumps({**REQUEST, "id": "rec-1"})
    lenient = clef_gguf("decide", "-m", tiny_model_dir, stdin=body)
    assert lenient.returncode == 0, lenient.stderr
    assert json.loads(lenient.stdout)["warnings"][0]["field"] == "id"
    strict = clef_gguf("decide", "-m", tiny_model_dir, "--strict", stdin=body)
    assert strict.returncode == 2
    assert json.loads(strict.stdout)["error"] == {
        "code": "unknown_field", "field": "id",
        "message": "unknown field 'id' (not a SystemOne request key)"}


@pytest.mark.parametrize("raw, code", [
    (b'{"state": "a", "state": "b", "questions": {"q": {"type": "noul"}}}', "invalid_json"),
    (b'{"state": NaN, "questions": {"q": {"type": "noul"}}}', "invalid_json"),
    (b'{"state": "\\ud800", "questions": {"q": {"type": "noul"}}}', "invalid_value"),
    (b"[" * 50_000 + b"]" * 50_000, "invalid_json"),
    (b'\xff\xfe{"state": 1}', "invalid_json"),
    (b'{"state": ' + b"7" * 5000 + b', "questions": {"q": {"type": "noul"}}}', "invalid_value"),
])
def test_bad_json_is_a_clear_error_not_a_crash(tiny_model_dir, tmp_path, raw, code):
    path = tmp_path / "req.json"
    path.write_bytes(raw)
    proc = clef_gguf("decide", "-m", tiny_model_dir, "--request", path)
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == code
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.parametrize("args", [["decide", "--threads", "-3"], ["decide", "--threads", "0"],
                                  ["decide", "--max-length", "0"], ["pick", "--ctx", "0"],
                                  ["serve", "--threads", "x"], ["serve", "--port", "70000"],
                                  ["serve", "--replicas", "0"], ["eval", "--seed", "-1"],
                                  ["calibrate", "--min-questions", "0"]])
def test_bad_numbers_are_refused_naming_the_flag(tiny_model_dir, args):
    proc = clef_gguf(*args, "-m", tiny_model_dir, stdin=json.dumps(REQUEST)) if args[0] != "pick" \
        else clef_gguf(*args)
    assert proc.returncode == 2
    assert args[1] in proc.stderr and "Traceback" not in proc.stderr


def test_too_long_request_is_refused(tiny_model_dir):
    proc = clef_gguf("decide", "-m", tiny_model_dir, "--max-length", 512,
                     stdin=json.dumps({**REQUEST, "state": "late " * 3000}))
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"]["code"] == "context_too_large"


def test_missing_model_exits_1(tmp_path):
    proc = clef_gguf("decide", "--model", tmp_path / "absent", stdin=json.dumps(REQUEST))
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"]["code"] == "model_not_found"
    assert "Traceback" not in proc.stderr


def test_every_command_has_help():
    for name in COMMANDS:
        proc = clef_gguf(name, "--help", timeout=120)
        assert proc.returncode == 0, (name, proc.stderr)
        assert "usage: clef-gguf " + name in proc.stdout


def test_convert_split_spelling_reaches_the_splitter(tiny_model_dir, tmp_path):
    # A qwen35 tower is not a native clef file: the splitter must refuse it, by name.
    proc = clef_gguf("convert", "split", tiny_model_dir / "tower-f32.gguf", tmp_path / "out")
    assert proc.returncode == 1, proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == "conversion_error" and "clef" in err["message"]
    assert not (tmp_path / "out" / "joint_head.safetensors").exists()


def test_closed_stdout_is_not_a_traceback(tiny_model_dir):
    # `clef-gguf decide ... | head -c 10`: the reader goes away before the answer is written.
    exe = shutil.which("clef-gguf")
    proc = subprocess.Popen([exe, "decide", "-m", str(tiny_model_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    _, err = proc.communicate(json.dumps(REQUEST), timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_decide_with_a_fine_tune(tiny_model_dir, tiny_fine_tunes):
    from clef_gguf import Clef

    with Clef.load(tiny_model_dir, adapters=tiny_fine_tunes) as clef:
        want = {name: clef.decide(dict(REQUEST, model=name))["answers"] for name in ("a", "b")}
    proc = clef_gguf("decide", "-m", tiny_model_dir, "--adapter", tiny_fine_tunes["a"], stdin=json.dumps(REQUEST))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["answers"] == want["a"] and out["model"] == "a" and out["audit"]["fine_tune"]["name"] == "a"
    several = ["--adapter", f"a={tiny_fine_tunes['a']}", "--adapter", f"b={tiny_fine_tunes['b']}"]
    proc = clef_gguf("decide", "-m", tiny_model_dir, *several, stdin=json.dumps(dict(REQUEST, model="b")))
    assert proc.returncode == 0 and json.loads(proc.stdout)["answers"] == want["b"]
    proc = clef_gguf("decide", "-m", tiny_model_dir, *several, stdin=json.dumps(dict(REQUEST, model="c")))
    assert proc.returncode == 0 and json.loads(proc.stdout)["warnings"][0]["code"] == "unknown_model"
    proc = clef_gguf("decide", "-m", tiny_model_dir, *several, "--strict", stdin=json.dumps(dict(REQUEST, model="c")))
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["code"] == "unknown_model"
    proc = clef_gguf("decide", "-m", tiny_model_dir, "--adapter", tiny_fine_tunes["a"], "--adapter",
                     tiny_fine_tunes["b"], stdin=json.dumps(REQUEST))
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["field"] == "adapter"


def _flags(command: str) -> dict:
    """``command``'s flags by their first spelling, as its parser declares them."""
    from clef_gguf.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    return {a.option_strings[0]: a for a in sub._actions if a.option_strings}


IN_WORDS = {"a", "all", "as", "the", "what", "every", "none", "no"}  # a default said in words, not a value


def test_every_default_a_help_text_states_is_the_flags_default():
    """Where a help text says "(default X)" of a flag whose default is a number or a word, X is that default:
    a help text cannot drift from the parser it describes."""
    import re

    checked = 0
    for command in COMMANDS:
        for flag, action in _flags(command).items():
            default = action.default
            if (default is None or isinstance(default, bool) or default == "auto"
                    or not isinstance(default, (int, float, str))):
                continue  # none, a switch, or a choice made at run time: the text describes it in words
            # "(default 64)", "(default: 64 ...)", or the value named first: "exact (default: fp32 ...)"
            for named, stated in re.findall(r"([^\s(]*) \(default:? ([^\s,;:)]+)", action.help or ""):
                if stated in IN_WORDS:
                    continue  # "(default: a free one)", "(default: all 30 published)"
                checked += 1
                if isinstance(default, (int, float)):
                    assert float(stated.replace(",", "")) == float(default), (command, flag, stated, default)
                else:
                    assert default in (stated.strip("'\"`"), named.strip("'\"`")), (command, flag, stated, default)
    assert checked > 40


STRICT_CASES = [  # (what --strict's help says it refuses, a request showing it, the code under --strict)
    ("unknown keys (unknown_field)", {**REQUEST, "id": "rec-1"}, "unknown_field"),
    ("a \"model\" this process does not serve (unknown_model)", {**REQUEST, "model": "not-served"}, "unknown_model"),
    ("1-64 questions", {"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
     "too_many_questions"),
    ("2-255 choice options", {"state": "s", "questions": {"c": {"type": "choice",
                                                               "criteria": {f"o{i}": None for i in range(256)}}}},
     "too_many_options"),
    ("2-10 score levels",
     {"state": "s", "questions": {"s": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
     "too_many_options"),
]


def test_strict_does_what_its_help_says_and_without_it_what_the_reference_does(tiny_model_dir):
    """Each refusal the --strict help names happens under --strict, and without it the request is answered
    as the help says: an unknown key ignored and named in "warnings", any model answered by the default
    model (no warning with one model loaded), the limits not applied."""
    from clef_gguf import Clef
    from clef_gguf.runtime.settings import LoadSettings

    text = " ".join(_flags("serve")["--strict"].help.split())
    assert "unknown keys are ignored and named in the response's \"warnings\"" in text
    assert "any \"model\" is answered by the default model (named in \"warnings\" only when fine-tunes" in text
    assert "the limits are not applied" in text
    def served(strict: bool):  # what the commands load (``runtime.flags.load_model``)
        return Clef.from_settings(LoadSettings.of(model=str(tiny_model_dir), strict=strict))

    with served(False) as lenient, served(True) as strict:
        for said, request, code in STRICT_CASES:
            assert said in text
            answered = lenient.decide(request)
            assert answered["answers"], said
            if code == "unknown_field":
                assert answered["warnings"][0]["field"] == "id"
            else:
                assert "warnings" not in answered, said
            if code == "unknown_model":
                assert answered["model"] == "not-served"
            with pytest.raises(Exception) as refused:
                strict.decide(request)
            assert getattr(refused.value, "code", None) == code, (said, refused.value)
