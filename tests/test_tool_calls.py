from prorl_adapter.service.chat import parse_tool_calls


def test_hermes_calls_in_order():
    text = (
        'Let me look.<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
        '<tool_call>\n{"name": "finish", "arguments": {"answer": "42"}}\n</tool_call><|im_end|>'
    )
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("bash", {"command": "ls"}), ("finish", {"answer": "42"})]
    assert parsed.errors == []


def test_openai_formats():
    as_string = parse_tool_calls('{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}')
    assert [(c.name, c.arguments) for c in as_string.calls] == [("bash", {"command": "pwd"})]
    wrapped = parse_tool_calls(
        '{"tool_calls": [{"type": "function", "function": {"name": "finish", "arguments": {}}}]}'
    )
    assert [c.name for c in wrapped.calls] == ["finish"]


def test_plain_text_is_no_call():
    parsed = parse_tool_calls("I think the answer is 4.")
    assert parsed.calls == [] and parsed.errors == []


def test_malformed_calls_become_messages():
    cases = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': 'string "name"',
        '<tool_call>{"name": "bash", "arguments": [1]}</tool_call>': "must be an object",
        '<tool_call>{"name": "bash", "arguments": "{bad"}</tool_call>': "not valid JSON",
        '<tool_call>{"name": "bash"': "never closed",
    }
    for text, message in cases.items():
        parsed = parse_tool_calls(text)
        assert parsed.calls == []
        assert len(parsed.errors) == 1 and message in parsed.errors[0], (text, parsed.errors)


def test_one_bad_call_does_not_hide_a_good_one():
    parsed = parse_tool_calls('<tool_call>oops</tool_call><tool_call>{"name": "bash", "arguments": {}}</tool_call>')
    assert [c.name for c in parsed.calls] == ["bash"]
    assert parsed.errors and parsed.errors[0].startswith("tool call 1")


def test_tool_call_regex_matches_exactly_the_allowed_calls():
    import json
    import re

    from prorl_adapter.service.chat import tool_call_regex

    commands = ["ls -la", "python3 -c 'print(6*7)'", 'echo "quoted" \\ back > out.txt']
    pattern = tool_call_regex("bash", "command", commands)
    for command in commands:
        call = json.dumps({"name": "bash", "arguments": {"command": command}})
        assert re.fullmatch(pattern, f"<tool_call>{call}</tool_call>")
        assert parse_tool_calls(f"<tool_call>{call}</tool_call>").calls[0].arguments["command"] == command
    assert not re.fullmatch(pattern, '<tool_call>{"name": "bash", "arguments": {"command": "rm -rf /"}}</tool_call>')
