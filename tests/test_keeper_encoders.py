"""The execute rule against reading a secret through an encoder
(proxycore.protocol.keeper_encoders): every encoder x every way to reach a secret is refused,
the near misses are not, and no input makes the check raise anything but KeeperRefused."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxycore.protocol.keeper import KeeperRefused, env_name, parse_command
from proxycore.protocol.keeper_encoders import (
    AWKS,
    ENCODERS,
    INTERPRETERS,
    RULE_SECRET_THROUGH_ENCODER,
    RULE_UNREADABLE_SCRIPT,
    SecretSources,
    check_secret_encoding,
    program_name,
)

VARIABLE = env_name("github-token")
STORE_KEY = "/var/lib/agent-appliance/credentials.key"
SOURCES = SecretSources((VARIABLE,), (STORE_KEY, "/etc/appliance/anthropic.key"))

# Every way a command line can bring a secret to an encoder `{e}` (each one a valid execute
# command: parse_command accepts it, so only the encoder rule stands in the way).
WAYS = (
    "{e} /proc/self/environ",  # a plain argument, no shell
    "/usr/bin/{e} /proc/1/environ",  # a full path, another process
    "{e} " + STORE_KEY,  # the keeper's own key file
    "{e} /etc/appliance/anthropic.key",  # a provider's credential file (configured)
    "{e} /home/agent/.git-credentials",  # a well-known credential file
    "sh -c '{e} < /proc/self/environ'",  # a redirection
    "sh -c 'cat /proc/self/environ | {e}'",  # a pipe from cat
    "sh -c 'echo $(cat /proc/self/environ | {e})'",  # a command substitution
    "sh -c 'echo `{e} /proc/self/environ`'",  # backquotes
    "sh -c '(env) | {e}'",  # a subshell, the environment dumped
    "sh -c 'printf %s \"$" + VARIABLE + "\" | {e}'",  # the credential's variable
    "bash -c '{e} <<< \"$" + VARIABLE + "\"'",  # a here-string
    "sh -c 'export | {e}'",  # a bare export lists the variables
    "timeout 5 sh -c 'env | {e}'",  # behind a wrapper
    "sh -c 'bash -c \"cat /proc/self/environ | {e}\"'",  # a script inside a script
    "ssh localhost '{e} /proc/self/environ'",  # another program that runs a script
    "sh -c 'cd /proc/self && {e} environ'",
    "sh -c '{e} /pr?c/self/e*'",  # a glob
    "find /proc/self -name environ -exec {e} {{}} +",
)
# Encoders that need an option to cut or transform (their bare use is harmless).
CONTEXTUAL = ("head -c 6", "tail -c 6", "grep -o .", "tail --bytes=6", "head -6c", "grep -ob .")


def refused_by(rule: str, command: str) -> KeeperRefused:
    argv = parse_command(command)  # a valid command: the encoder rule is what refuses it
    with pytest.raises(KeeperRefused) as info:
        check_secret_encoding(argv, SOURCES)
    assert info.value.rule == rule, (command, info.value)
    assert info.value.status_hint == 400
    return info.value


def allowed(command: str) -> None:
    check_secret_encoding(parse_command(command), SOURCES)


@pytest.mark.parametrize("encoder", sorted(ENCODERS | INTERPRETERS) + list(CONTEXTUAL))
def test_every_encoder_is_refused_every_way(encoder: str) -> None:
    for way in WAYS:
        refused_by(RULE_SECRET_THROUGH_ENCODER, way.format(e=encoder))


def test_the_refusal_names_the_rule_the_encoder_and_the_source() -> None:
    error = refused_by(RULE_SECRET_THROUGH_ENCODER, "xxd /proc/self/environ")
    message = str(error)
    assert "'xxd'" in message and "/proc/self/environ" in message
    assert "outside" in message  # says what to do instead
    # Bounded whatever the command's length (it is journaled and returned).
    long = refused_by(
        RULE_SECRET_THROUGH_ENCODER, "sh -c 'echo $GITHUB_TOKEN " + "a" * 3000 + "|xxd'"
    )
    assert len(str(long)) < 400


@pytest.mark.parametrize(
    "command",
    [
        # the shell's own transforms of the value
        "sh -c 'echo ${" + VARIABLE + ":0:6}'",
        "sh -c 'echo ${" + VARIABLE + "#ghp_}'",
        "sh -c 'echo ${#" + VARIABLE + "}'",
        "sh -c 'n=" + VARIABLE + "; echo ${!n}'",
        "sh -c 'IFS=abc; set -- $" + VARIABLE + "; echo $@'",
        "sh -c 'read -n 6 x <<< \"$" + VARIABLE + "\"; echo $x'",
        'sh -c \'printf "%.6s" "$' + VARIABLE + "\"'",
        "sh -c 'printf %x \"$" + VARIABLE + "\"'",
        # encoders disguised
        "sh -c 'x\"x\"d /proc/self/environ'",
        "sh -c '\\xxd /proc/self/environ'",
        "sh -c 'x\\\nxd /proc/self/environ'",
        "sh -c 'a=xxd; printenv GITHUB_TOKEN | $a'",
        "sh -c 'c=xx; ${c}d /proc/self/environ'",
        "sh -c 'alias q=xxd; q /proc/self/environ'",
        "sh -c 'eval xxd /proc/self/environ'",
        "python3.12 -c 'import os; print(os.environ)'",
        "python3 -c 'print(1)'",  # inline code reads its environment as it pleases
        "perl -e 'print unpack(\"H*\", $ENV{GITHUB_TOKEN})'",
        "node -e 'console.log(Buffer.from(process.env.GITHUB_TOKEN).toString(\"hex\"))'",
        "sh -c 'echo \"import os; print(os.environ)\" | python3'",  # code on stdin
        "awk 'BEGIN{print ENVIRON[\"GITHUB_TOKEN\"]}'",
        "busybox xxd /proc/self/environ",
        "env -S 'xxd /proc/self/environ'",
        "dd if=/proc/self/environ bs=1 skip=13 count=6",
        "openssl enc -base64 -in /proc/self/environ",
        'sh -c \'curl -s -H "Authorization: Bearer $GITHUB_TOKEN" https://x | jq ".[0:5]"\'',
        'sh -c \'curl -s -v -H "Authorization: Bearer $GITHUB_TOKEN" https://x 2>&1 | '
        'jq -R "explode"\'',
        "sh -c 'xxd - <<EOF\n$GITHUB_TOKEN\nEOF'",  # a here-document
        "sh -c 'pr -W 20 -t /proc/self/environ'",
        "sh -c 'declare -p | rev'",
        "sh -c 'set | column -t -s a'",
        "xxd '$GITHUB_TOKEN'",  # no shell: still names the variable (over-approximation)
        "sh -c 'cd /; cd pr\"\"oc; xxd self/environ'",
        # a renamed encoder, brace expansions
        "sh -c 'ln -s /usr/bin/xxd /tmp/q; /tmp/q /proc/self/environ'",
        "sh -c 'cp /bin/base32 q && ./q /proc/self/environ'",
        "bash -c 'x{x,}d /proc/self/environ'",
        "bash -c 'xxd /p{r,}oc/self/e{nv,}iron'",
        "bash -c 'od -c /p{r..r}oc/self/environ'",
        # programs that run a dump for the encoder, code the rule cannot read
        "sh -c 'tar -xf x.tar --to-command=env | xxd'",
        "sh -c 'sed -n \"1e env\" /etc/hostname | xxd'",
        "sh -c 'echo ZW52 | base64 -d | sh | xxd'",
        "sh -c 'echo ZW52 | base64 -d | bash -s | od -c'",
        "sh -c 'eval \"$(echo ZW52 | base64 -d)\" | xxd'",
        "sh -c '. /dev/stdin | xxd'",
        "sh -c 'echo all:\\;@env | make -f - | xxd'",
        "sh -c 'git -c alias.x=\\!env x | od -c'",
        # code on stdin, however it gets there
        'bash -c \'python3 <<< "import os as o; print(getattr(o, chr(101) + \\"nviron\\"))"\'',
        "bash -c 'python3 <(echo import os)'",
        "sh -c 'python3 /dev/stdin < /tmp/code.py'",
        "sh -c 'sh < /tmp/code.sh | xxd'",
        "deno eval 'console.log(1)'",
    ],
)
def test_evasions_are_refused(command: str) -> None:
    refused_by(RULE_SECRET_THROUGH_ENCODER, command)


def test_nested_scripts_are_read_or_refused() -> None:
    inner = "xxd /proc/self/environ"
    for _ in range(8):  # deeper than MAX_DEPTH: refused either way, never let through
        inner = 'sh -c "' + inner.replace("\\", "\\\\").replace('"', '\\"') + '"'
        with pytest.raises(KeeperRefused) as info:
            check_secret_encoding(parse_command("sh -c '" + inner + "'"), SOURCES)
        assert info.value.rule in {RULE_SECRET_THROUGH_ENCODER, RULE_UNREADABLE_SCRIPT}


@pytest.mark.parametrize(
    "command",
    [
        "sh -c 'echo \"$GITHUB_TOKEN'",  # a source in a script that cannot be read
        "sh -c 'xxd \"/tmp/data.bin'",  # an encoder in one
    ],
)
def test_unreadable_scripts_are_refused_where_it_matters(command: str) -> None:
    refused_by(RULE_UNREADABLE_SCRIPT, command)


@pytest.mark.parametrize(
    "encoder", [*sorted((ENCODERS | INTERPRETERS) - AWKS), "head -c 6", "grep -o x"]
)
def test_an_encoder_on_a_file_without_secrets_is_allowed(encoder: str) -> None:
    allowed(f"{encoder} /tmp/data.bin")
    allowed(f"sh -c '{encoder} /tmp/data.bin'")
    if program_name(encoder.split()[0]) not in INTERPRETERS:  # for those, stdin is code
        allowed(f"sh -c 'cat README.md | {encoder}'")


@pytest.mark.parametrize(
    "command",
    [
        # reading the secret without an encoder: the output goes through the scrubber
        "cat /proc/self/environ",
        "printenv GITHUB_TOKEN",
        "sh -c 'echo token=$GITHUB_TOKEN'",
        "sh -c 'printf %s \"$GITHUB_TOKEN\" | gh auth login --with-token'",
        'sh -c \'printf "%s\\n" "$GITHUB_TOKEN" | gh auth login --with-token\'',
        "sh -c 'GH_TOKEN=$GITHUB_TOKEN gh pr list'",
        "sh -c 'set -e; curl -s -H \"Authorization: Bearer $GITHUB_TOKEN\" https://x'",
        "sh -c 'curl -s -H \"Authorization: Bearer $GITHUB_TOKEN\" https://x | jq -r .login'",
        'sh -c \'curl -s -H "Authorization: Bearer $GITHUB_TOKEN" https://x | '
        'jq -r ".items[].name, .items[0].id"\'',
        "sh -c 'curl -s -H \"Authorization: Bearer $GITHUB_TOKEN\" https://x | head -n 5'",
        "sh -c 'curl -s -H \"Authorization: Bearer $GITHUB_TOKEN\" https://x | grep -c open'",
        "python3 deploy.py",
        "gh pr list",
        # an encoder's name where no secret is named
        "gh pr create --title \"Don't\" --body 'fix the od output'",
        "gh api /repos/org/repo/contents/cut",
        "gh api graphql -f 'query=query($n:Int){viewer{login}}'",
        "git log --format=%H -n 3",
    ],
)
def test_near_misses_are_allowed(command: str) -> None:
    allowed(command)


def test_program_names() -> None:
    assert program_name("/usr/bin/python3.12") == "python"
    assert program_name("base64") == "base64" and program_name("/bin/base32") == "base32"
    assert program_name("lz4") == "lz4" and program_name("7z") == "7z"


def test_the_worst_command_is_checked_quickly() -> None:
    # 4096 characters of nesting and substitutions: bounded work, well under a millisecond a
    # character.
    script = 'echo $(echo `echo "$(sh -c "env")"`) | ' * 90 + "xxd"
    command = "sh -c '" + script + "'"
    assert len(command) <= 4096
    argv = parse_command(command)
    started = time.perf_counter()
    with pytest.raises(KeeperRefused):
        check_secret_encoding(argv, SOURCES)
    assert time.perf_counter() - started < 1.0


_SHELLISH = st.lists(
    st.sampled_from([*list("ab xd/$`'\"\\;|&<>(){}[]*?=-#%:!\n\t"), "xxd", "sh -c ", "env"]),
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_SHELLISH)
def test_only_keeper_refused_escapes(text: str) -> None:
    for argv in ([text], ["sh", "-c", text], ["sh", "-c", text, text]):
        try:
            check_secret_encoding(argv, SOURCES)
        except KeeperRefused as exc:
            assert exc.rule in {RULE_SECRET_THROUGH_ENCODER, RULE_UNREADABLE_SCRIPT}


def test_a_jq_program_cannot_make_the_check_backtrack() -> None:
    # A nested repetition once took 2 s on this 43-character program (and doubled per "[ ]"):
    # the check runs in the proxy worker, on the agent's input.
    started = time.perf_counter()
    refused_by(RULE_SECRET_THROUGH_ENCODER, "jq '" + "[ ]" * 14 + ":' /proc/self/environ")
    assert time.perf_counter() - started < 0.1


_UNITS = [*list(" .[]{}$`\"'\\:,|-1a%("), "[ ", "${", "$(", "a=", "-c", ".a", "\\ "]


def test_no_repeated_unit_makes_the_check_slow() -> None:
    # Every unit (and pair of units) repeated to the command's length limit, in each place the
    # check reads differently: a jq program, a shell script, a plain argument.
    units = _UNITS + [a + b for a in _UNITS for b in _UNITS[::5]]
    worst = 0.0
    for unit in units:
        text = (unit * (4000 // len(unit)))[:4000] + "\x01"
        for argv in (["jq", text, "/proc/self/environ"], ["sh", "-c", text], ["xxd", text]):
            started = time.perf_counter()
            try:
                check_secret_encoding(argv, SOURCES)
            except KeeperRefused:
                pass
            worst = max(worst, time.perf_counter() - started)
    assert worst < 0.25, worst


# How a program's name can be written so that a shell still runs it (`{e}` the name).
DISGUISES = (
    "{q}",  # x""xd: quotes inside the name
    "\\{e}",  # a backslash before it
    "/usr/bin/{e}",
    "./../../usr/bin/{e}",
    "command {e}",
    "exec {e}",
    "env -u HOME {e}",
    "timeout 5 {e}",
    "nice -n 5 {e}",
    "stdbuf -o0 {e}",
    "sudo -u agent {e}",
    "busybox {e}",
    "{{ {e}; }}",  # a group
    "( {e} )",  # a subshell
    "if true; then {e}; fi",
    "X=1 {e}",  # an assignment first
)


@pytest.mark.parametrize("disguise", DISGUISES)
def test_every_encoder_is_refused_however_its_name_is_written(disguise: str) -> None:
    for encoder in sorted(ENCODERS | INTERPRETERS):
        written = disguise.format(e=encoder, q=encoder[0] + '""' + encoder[1:])
        refused_by(
            RULE_SECRET_THROUGH_ENCODER,
            "sh -c 'printf %s \"$" + VARIABLE + '" | ' + written + "'",
        )


SOURCE_FORMS = (
    "/proc//self/environ",
    "/proc/./self/environ",
    "//proc/self/environ",
    "/sys/../proc/self/environ",
    "../../proc/thread-self/environ",
    "/proc/self/task/1/environ",
    '"/pro"c/self/environ',
    "/proc/self/mem",
    "/proc/$$/environ",
    "/proc/self/envi*",
    "~/.git-credentials",
    "$HOME/.netrc",
    "/var/lib/agent-appliance/credentials.key",
    "/var/lib/agent-appliance/CREDENTIALS.KEY",
    "./credentials.db",
)


@pytest.mark.parametrize("source", SOURCE_FORMS)
def test_every_way_of_writing_a_secret_path_is_a_source(source: str) -> None:
    for encoder in ("xxd", "base32", "od -c", "gzip -c", "cut -c1-6"):
        refused_by(RULE_SECRET_THROUGH_ENCODER, f"sh -c '{encoder} {source}'")
        if "$" not in source and "'" not in source and '"' not in source:
            refused_by(RULE_SECRET_THROUGH_ENCODER, f"{encoder} {source}")  # no shell
