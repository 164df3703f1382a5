"""The keeper's validation rules (proxycore.protocol.keeper): the L1 fast path and the command
check."""

from __future__ import annotations

import pytest

from proxycore.protocol.keeper import (
    MAX_FIELD_LENGTH,
    RULE_CONTROL_CHARACTER,
    RULE_EMPTY_COMMAND,
    RULE_EMPTY_INTENT,
    RULE_METACHARACTER,
    RULE_NOT_TEXT,
    RULE_NUL_BYTE,
    RULE_TOO_LONG,
    RULE_TRAILING_BACKSLASH,
    RULE_UNTERMINATED_QUOTE,
    Action,
    KeeperRefused,
    Level,
    check_intent,
    fast_path_allows,
    intent_is_substantive,
    parse_command,
)

GOOD_INTENT = "list open pull requests of org/repo"


def refused(rule: str, command: object) -> None:
    with pytest.raises(KeeperRefused) as info:
        parse_command(command)
    assert info.value.rule == rule, info.value
    assert info.value.status_hint == 400


# --- intents and the L1 fast path -------------------------------------------------------------


@pytest.mark.parametrize("intent", ["", " ", "\t\n\r ", "\u3000\u00a0", "\u200b\u200b\ufeff"])
def test_empty_and_whitespace_intents_are_refused_before_any_model(intent: str) -> None:
    with pytest.raises(KeeperRefused) as info:
        check_intent(intent)
    assert info.value.rule == RULE_EMPTY_INTENT


def test_intent_limits() -> None:
    assert check_intent("a" * MAX_FIELD_LENGTH) == "a" * MAX_FIELD_LENGTH
    with pytest.raises(KeeperRefused) as info:
        check_intent("a" * (MAX_FIELD_LENGTH + 1))
    assert info.value.rule == RULE_TOO_LONG
    with pytest.raises(KeeperRefused) as info:
        check_intent("read the token\x00")
    assert info.value.rule == RULE_NUL_BYTE
    for value in (None, 3, b"bytes intent here", ["x"]):
        with pytest.raises(KeeperRefused) as info:
            check_intent(value)
        assert info.value.rule == RULE_NOT_TEXT


@pytest.mark.parametrize(
    ("intent", "substantive"),
    [
        ("abcdefghij", True),  # exactly 10, all distinct
        ("abcdefghi", False),  # 9
        ("abc abc abc a", True),  # 10 non-whitespace, 3 distinct
        ("abc  abc\tabc", False),  # 9 non-whitespace
        ("aaaaaaaaaa", False),  # filler: 1 distinct
        ("ababababab", False),  # 2 distinct
        ("aAaAaAaAaA", False),  # case does not make filler distinct
        ("a", False),
        ("a b c d e f g h i j", True),
        ("abab\u200b\u200b\u200b\u200b\u200b\u200bc", False),  # invisibles do not count
        ("déploiement", True),
    ],
)
def test_substantive_intent_thresholds(intent: str, substantive: bool) -> None:
    assert intent_is_substantive(intent) is substantive


def test_fast_path_is_request_of_l1_only() -> None:
    assert fast_path_allows(Action.REQUEST, Level.L1, GOOD_INTENT)
    assert not fast_path_allows(Action.EXECUTE, Level.L1, GOOD_INTENT)
    assert not fast_path_allows(Action.REQUEST, Level.L2, GOOD_INTENT)
    assert not fast_path_allows(Action.REQUEST, Level.L3, GOOD_INTENT)
    assert not fast_path_allows(Action.REQUEST, Level.L1, "aaaaaaaaaa")
    assert not fast_path_allows(Action.REQUEST, Level.L1, "short")


# --- execute commands -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("ls", ("ls",)),
        ("  ls   -la\t/tmp  ", ("ls", "-la", "/tmp")),
        ("gh pr list --repo 'org/repo'", ("gh", "pr", "list", "--repo", "org/repo")),
        ("echo 'a;b|c&&d||e>f<g`h$(i)\nj\rk'", ("echo", "a;b|c&&d||e>f<g`h$(i)\nj\rk")),
        ("echo '' x", ("echo", "", "x")),
        ('echo "a b" c\\ d', ("echo", "a b", "c d")),
        ('echo "a\\"b" "c\\\\d" "e\\f"', ("echo", 'a"b', "c\\d", "e\\f")),
        ("echo it\\'s", ("echo", "it's")),
        ("echo 'a'\"b\"c", ("echo", "abc")),
        ("echo $HOME ${X} $", ("echo", "$HOME", "${X}", "$")),  # never expanded
        ("echo * ~ {a,b} (x)", ("echo", "*", "~", "{a,b}", "(x)")),
        (
            'curl -H "Authorization: Bearer $T" https://x',
            ("curl", "-H", "Authorization: Bearer $T", "https://x"),
        ),
    ],
)
def test_accepted_commands_split_like_posix_shlex(command: str, argv: tuple[str, ...]) -> None:
    assert parse_command(command) == argv


@pytest.mark.parametrize(
    "command",
    [
        "ls; id",
        "ls ;",
        "ls | id",
        "ls || id",
        "ls & id",
        "ls && id",
        "sleep 1 &",
        "echo `id`",
        "echo x > f",
        "echo x >> f",
        "cat < f",
        "cat <(id)",
        "cat <<EOF",
        "cat <<<word",
        "echo $(id)",
        "echo a\nid",
        "echo a\rid",
        'echo "$(id)"',  # double quotes protect nothing
        'echo "a;b"',
        'echo "`id`"',
        "echo \\;",  # an escaped metacharacter is still refused
        "echo \\|",
        "echo \\>",
        "echo $\\(id)",
        "echo \\$(id)",
        'echo $"("id)',  # '$(' glued from different quoting
        "echo '$'(id)",
        "echo '$''('id)",
        "echo 'a'; id",
        "echo 'a' | id",
    ],
)
def test_metacharacters_outside_single_quotes_are_refused(command: str) -> None:
    refused(RULE_METACHARACTER, command)


@pytest.mark.parametrize("command", ["echo a\x1bb", "echo a\x0bb", "echo a\x7f", '"\x01"'])
def test_control_characters_outside_single_quotes_are_refused(command: str) -> None:
    refused(RULE_CONTROL_CHARACTER, command)


def test_structure_refusals() -> None:
    refused(RULE_EMPTY_COMMAND, "")
    refused(RULE_EMPTY_COMMAND, " \t ")
    refused(RULE_UNTERMINATED_QUOTE, "echo 'abc")
    refused(RULE_UNTERMINATED_QUOTE, 'echo "abc')
    refused(RULE_UNTERMINATED_QUOTE, "echo 'a;b")
    refused(RULE_TRAILING_BACKSLASH, "echo abc\\")
    refused(RULE_NUL_BYTE, "echo a\x00b")
    refused(RULE_NUL_BYTE, "echo 'a\x00b'")  # NUL is refused even inside single quotes
    refused(RULE_TOO_LONG, "a" * (MAX_FIELD_LENGTH + 1))
    assert parse_command("a" * MAX_FIELD_LENGTH) == ("a" * MAX_FIELD_LENGTH,)
    for value in (None, b"ls", 1, ["ls"]):
        refused(RULE_NOT_TEXT, value)


def test_refusal_names_the_position() -> None:
    with pytest.raises(KeeperRefused, match="';' at 2"):
        parse_command("ls; id")
