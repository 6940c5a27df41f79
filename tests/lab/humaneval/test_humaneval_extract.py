"""Answer extraction: reasoning with decoy blocks, several blocks, no fence, truncated answers, programs."""

from __future__ import annotations

from ddtree.lab.humaneval.extract import build_program, extract_code, fenced_blocks, strip_reasoning

ADD_PROMPT = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n'
ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def _run(program: str) -> bool:
    namespace: dict = {}
    try:
        exec(compile(program, "<test>", "exec"), namespace)  # trusted, tiny programs built in this test
    except AssertionError:
        return False
    return True


def test_thinking_text_with_decoy_blocks():
    text = ("<think>Maybe\n```python\ndef add(a, b):\n    return a - b\n```\nno wait, a decoy.</think>\n"
            "Final answer:\n```python\ndef add(a, b):\n    return a + b\n```\n")
    ex = extract_code(text)
    assert ex.source == "fenced" and ex.code == "def add(a, b):\n    return a + b\n"
    assert not ex.in_reasoning


def test_last_think_close_wins():
    text = ("<think>a</think>\n```python\nx = 1\n```\n<think>b\n```python\nx = 2\n```</think>answer:\n"
            "```python\nx = 3\n```")
    assert extract_code(text).code == "x = 3\n"


def test_separate_reasoning_field_needs_no_stripping():
    # SGLang/vLLM return reasoning separately: the content is the answer even if it has no <think> tags
    assert strip_reasoning("```python\nx = 1\n```") == ("```python\nx = 1\n```", False)


def test_last_of_several_blocks_and_tag_preference():
    text = "First:\n```python\nv = 1\n```\nThen:\n```py\nv = 2\n```\nAnd a shell line:\n```bash\nls\n```\n"
    assert extract_code(text).code == "v = 2\n"
    untagged = "```\nw = 1\n```\nor\n```\nw = 2\n```"
    assert extract_code(untagged).code == "w = 2\n"
    assert [b[0] for b in fenced_blocks(text)] == ["python", "py", "bash"]


def test_no_fence_uses_raw_text_and_stops_for_completion_models():
    completion = "    return a + b\n\n\ndef test():\n    assert add(1, 1) == 3\n\nprint(test())\n"
    ex = extract_code(completion, completion_mode=True)
    assert ex.source == "raw" and ex.code == "    return a + b\n\n"
    assert extract_code(completion).code == completion  # chat mode: raw text kept whole


def test_truncated_answers():
    open_fence = "Here:\n```python\ndef add(a, b):\n    return a +"
    ex = extract_code(open_fence)
    assert ex.source == "fenced" and ex.code == "def add(a, b):\n    return a +\n"
    in_reasoning = "<think>let me consider ```python\ndef add(a, b):"
    ex = extract_code(in_reasoning)
    assert ex.in_reasoning and ex.source == "none" and ex.code == ""


def test_indented_block_is_dedented():
    text = "1. Do this:\n   ```python\n   def add(a, b):\n       return a + b\n   ```\n"
    assert extract_code(text).code == "def add(a, b):\n    return a + b\n"


def test_programs_from_each_kind_of_answer_run_the_tests():
    body = "    return a + b\n"
    full = "def add(a, b):\n    return a + b\n"
    flat_body = "return a + b\n"
    wrong = "def add(a, b):\n    return a * b\n"
    assert _run(build_program(ADD_PROMPT, body, ADD_TEST, "add"))
    assert _run(build_program(ADD_PROMPT, full, ADD_TEST, "add"))
    assert _run(build_program(ADD_PROMPT, flat_body, ADD_TEST, "add"))
    assert not _run(build_program(ADD_PROMPT, wrong, ADD_TEST, "add"))
    assert build_program(ADD_PROMPT, body, ADD_TEST, "add").endswith("check(add)\n")


def test_prompt_helpers_survive_a_full_redefinition():
    prompt = 'def helper(x):\n    return x * 2\n\n\ndef double_all(xs):\n    """Double every item."""\n'
    test = "def check(candidate):\n    assert candidate([1, 2]) == [2, 4]\n"
    answer = "```python\ndef double_all(xs):\n    return [helper(x) for x in xs]\n```"
    assert _run(build_program(prompt, extract_code(answer).code, test, "double_all"))
