"""The execute rule against reading a secret through an encoder (sans-IO).

Theory of operation
-------------------
An execute runs the agent's argv with the credential's value in its environment, and returns
the output through the scrubber. The scrubber recognises the value and the forms it knows how
to decode; a command that pipes the value through `xxd`, `gzip`, `rev` or `cut -c1-6` returns
it in a form no scrubber can be sure to recognise (the last one in pieces of six characters,
one call per piece). So `check_secret_encoding` refuses a command that, anywhere in it, both

- names a **secret source**: the credential's environment variable (`GITHUB_TOKEN`, as an
  identifier anywhere: `$GITHUB_TOKEN`, `printenv GITHUB_TOKEN`, `ENV['GITHUB_TOKEN']`); an
  environment dump (`env`, `printenv`, `compgen`, also inside an option or an embedded
  script: `--to-command=env`, `sed '1e env'`; a bare `set`/`export`/`declare`/`typeset`/
  `readonly` or with `-p` only); anything under `/proc` or containing `environ` or `getenv`;
  a file that holds a secret (`SECRET_PATH_NAMES`, and the paths applianced adds: its
  credential store and key file, the providers' credential files); inside a shell script, any
  expansion (`$`, backquote: it reads the environment, which holds the value), any glob or
  brace expansion (it may name one of those paths); code this rule does not read: an
  interpreter given code inline (`-c`, `-e`...) or on stdin, a shell reading commands from
  stdin, `eval`, `source`, `.`;
- and runs an **encoder**: the command word, or behind a wrapper (`WRAPPERS`: `timeout`,
  `env`, `xargs`, `find`...) any later word, whose basename (directories and a version suffix
  dropped: `/usr/bin/python3.12` is `python`) is in `ENCODERS` or `INTERPRETERS`; any word that
  is a path to one (it may be renamed: `ln -s /usr/bin/xxd q`); `head`/`tail` with a byte
  count; `grep` with `-o`; `printf` with a conversion other than `%s`, `%b`, `%%`; `jq` and its
  kin with anything but a path expression (`.items[].name`); and inside a shell script, a
  command named by an expansion, a glob or braces, `eval`, `source`, `.`, `read`, `mapfile`,
  `alias`, an `IFS` assignment, a parameter expansion with an operator (`${X:0:6}`, `${#X}`,
  `${!X}`).

Where the words come from: the argv is one piece (no shell: `$` is literal there). Where a
piece holds a program that runs a word as a script (`SCRIPT_RUNNERS`: the shells, `su`, `ssh`,
`watch`, `env -S`, `sudo`...), each of its words that holds shell syntax (blanks, quotes, `$`,
backquotes, `;|&<>(){}`, globs) is read as a shell script (POSIX `shlex` with punctuation split
off, `$(` and backquotes opened), and so on down to `MAX_DEPTH` levels; inside a script, a word
with a command substitution (`$(...)`, backquotes) is always read (POSIX 2.6.3). So
`sh -c '...'`, `ssh host '...'`, `find -exec sh -c '...'`, `timeout 5 bash -c "..."` are read
without knowing which option of which program takes the script. Reading every such word as a
script over-approximates (an argument of `sh -c '...' x y` is read too); the rule refuses only
the conjunction of a source and an encoder, so the cost is a refusal, never a leak.

What cannot be read (an unterminated quote, a trailing backslash, nesting beyond `MAX_DEPTH`)
is refused when the command has a source or an encoder anywhere (fail closed where it matters;
`gh pr create --title "Don't"` is still allowed). A refusal names the rule, the encoder and the
source, and says what to do instead: run the encoder on the keeper's output, outside it.

Cost: the check runs in the proxy worker on the agent's input, so it is linear: shlex, splits
and regular expressions without nested repetition (a backtracking jq pattern once took seconds
on a 43-character program; tests/test_keeper_encoders.py repeats every unit to 4000 characters
and bounds the time).

Limits (docs/keeper.md says them to operators): this reads text. A program or script the agent
wrote into its container, a symbolic link to `/proc/self/environ` made in an earlier call, a
variable that holds the value under another name set by an earlier command: none of them is
visible in the command line. The gatekeeper model and, above all, what a credential is granted
for are the boundary; this rule stops the one-line forms.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from proxycore.protocol.keeper import KeeperRefused

RULE_SECRET_THROUGH_ENCODER = "secret_through_encoder"  # noqa: S105 (a rule name)
RULE_UNREADABLE_SCRIPT = "unreadable_script"

MAX_DEPTH = 4  # nested scripts read (sh -c "bash -c '...$(...)'" is three)

# Programs that turn bytes into a form the scrubber may not recognise, or reorder or cut them.
ENCODERS = frozenset(
    {
        # hex, octal and base-N dumpers
        "xxd", "hexdump", "hd", "od", "base32", "base64", "basenc", "base58", "base85",
        "ascii85", "uuencode", "uudecode",
        # compressors and archivers
        "gzip", "gunzip", "zcat", "pigz", "bzip2", "bunzip2", "bzcat", "pbzip2", "xz", "unxz",
        "xzcat", "pixz", "lzma", "unlzma", "lzcat", "zstd", "unzstd", "zstdcat", "pzstd", "lz4",
        "lz4c", "lz4cat", "unlz4", "lzop", "lzip", "brotli", "compress", "uncompress", "zip",
        "7z", "7za", "7zr", "tar", "cpio", "ar",
        # ciphers and charset converters
        "openssl", "gpg", "gpg2", "age", "ccrypt", "mcrypt", "iconv", "recode", "uconv",
        # reorder, cut, translate
        "rev", "tac", "tr", "cut", "fold", "split", "csplit", "dd", "strings", "expr", "sed",
        "shuf", "xargs", "column", "join", "pr", "colrm",
        # multi-call binaries: any of the above under another name
        "busybox", "toybox",
    }
)  # fmt: skip
# Programs that run code: they encode anything they read (and read the environment when the
# code is inline, see _is_inline_interpreter).
INTERPRETERS = frozenset(
    {
        "python", "pypy", "perl", "ruby", "irb", "node", "nodejs", "deno", "bun", "php", "lua",
        "luajit", "tclsh", "wish", "expect", "rscript", "julia", "pwsh", "powershell", "awk",
        "gawk", "mawk", "nawk", "sqlite3", "bc", "dc", "m4", "vim", "vi", "nvim", "ex", "ed",
        "emacs", "jshell", "groovy", "osascript",
    }
)  # fmt: skip
# Programs that run a word as a shell script (or split it into a command line).
SCRIPT_RUNNERS = frozenset(
    {
        "sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "yash", "posh", "fish", "tcsh",
        "csh", "rbash", "busybox", "toybox", "su", "runuser", "script", "flock", "watch",
        "ssh", "parallel", "tmux", "screen", "env", "eval", "nsenter", "chroot", "sudo", "doas",
    }
)  # fmt: skip
# Programs that run another program named among their arguments.
WRAPPERS = SCRIPT_RUNNERS | frozenset(
    {
        "exec", "command", "builtin", "time", "timeout", "nice", "nohup", "stdbuf", "setsid",
        "ionice", "chrt", "taskset", "unbuffer", "strace", "ltrace", "xargs", "find",
        "parallel", "watch", "catchsegv", "valgrind", "gdb", "systemd-run", "firejail",
        "bwrap", "unshare", "prlimit", "cgexec", "numactl", "caffeinate",
    }
)  # fmt: skip
BYTE_SLICERS = frozenset({"head", "tail"})  # with -c / --bytes
MATCH_PRINTERS = frozenset({"grep", "egrep", "fgrep", "rg", "ag", "ack"})  # with -o
JSON_QUERIES = frozenset({"jq", "gojq", "jaq", "yq"})  # unless a path expression
DUMPERS = frozenset({"env", "printenv", "compgen"})
BARE_DUMPERS = frozenset({"set", "export", "declare", "typeset", "readonly", "local"})
SHELL_TRANSFORMS = frozenset({"eval", "source", ".", "read", "mapfile", "readarray", "alias"})
CODE_RUNNERS = frozenset({"eval", "source", "."})  # code from a string or a file: unread
SHELLS = frozenset(
    {"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "yash", "posh", "fish", "tcsh", "csh",
     "rbash"}
)  # fmt: skip
AWKS = frozenset({"awk", "gawk", "mawk", "nawk"})  # the program is always inline
# Files that hold a secret wherever they are (matched case-insensitively inside a word).
SECRET_PATH_NAMES = (
    "credentials.db",
    "credentials.key",
    ".git-credentials",
    ".netrc",
    ".npmrc",
    ".pypirc",
    "gh/hosts.yml",
    ".aws/credentials",
    ".docker/config.json",
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ed25519",
    ".env",
)
SOURCE_FRAGMENTS = ("environ", "getenv", "/proc")

_SHELL_SYNTAX = re.compile(r"[\s$`;|&<>(){}*?\[\]'\"\\]")
_OPERATOR_CHARS = frozenset("();<>|&")
_REDIRECT = re.compile(r"[<>]")
_GLOB = re.compile(r"[*?\[]")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+?=")
# ${X:...} ${X#...} ${X%...} ${X/...} ${X^...} ${X,...} ${X@...} ${#X} ${!X}: the value
# transformed by the shell itself (POSIX 2.6.2; bash's substring and case operators).
_EXPANSION_OPERATOR = re.compile(r"\$\{\s*[#!]|\$\{[A-Za-z_0-9@*]*[^A-Za-z_0-9}]")
# A jq program that only selects (.a, .a.b, .items[], .[0], a | b, a, b): no string is built,
# cut or formatted. Two linear checks, no nested repetition: every regex here runs on agent
# input in the proxy worker, so none may backtrack (a nested `(?:\s+|...)*` took seconds on
# a 43-character program).
_PATH_CHARS = re.compile(r'[\s.\[\]|,0-9A-Za-z_"-]*')
_BARE_NAME = re.compile(r"(?<![.\w])[A-Za-z_]")  # a name not after a dot: a function, a keyword
_PARTS = re.compile(r"[^A-Za-z0-9_-]+")  # the names inside an option or an embedded script
STDIN = "/dev/stdin"
_OPENED = "\ue000"  # a private-use character: where a command substitution was opened
_CRUDE_SPLIT = re.compile(r"[\s;|&<>()`{}]+")
_INLINE_FLAGS = frozenset("ceEpr")
_INLINE_LONG = ("--eval", "--print", "--command", "--exec", "--execute", "--run")
_RESERVED = frozenset({"if", "then", "else", "elif", "do", "while", "until", "!", "time", "{"})


@dataclass(frozen=True)
class SecretSources:
    """What holds a secret for one execute: the credential's variable, extra paths."""

    variables: tuple[str, ...]
    paths: tuple[str, ...] = ()

    def patterns(self) -> tuple[re.Pattern[str], ...]:
        return tuple(
            re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", re.IGNORECASE)
            for name in self.variables
            if name
        )

    def path_names(self) -> tuple[str, ...]:
        names = {name.lower() for name in SECRET_PATH_NAMES}
        for path in self.paths:
            if path:
                names.add(path.lower())
                base = path.rstrip("/").rsplit("/", 1)[-1].lower()
                if base:
                    names.add(base)
        return tuple(sorted(names))


@dataclass
class _Findings:
    sources: SecretSources
    variables: tuple[re.Pattern[str], ...]
    path_names: tuple[str, ...]
    source: str | None = None
    encoder: str | None = None
    unreadable: str | None = None
    pieces: list[tuple[list[str], bool]] = field(default_factory=list)

    def found_source(self, why: str) -> None:
        if self.source is None:
            self.source = why

    def found_encoder(self, why: str) -> None:
        if self.encoder is None:
            self.encoder = why


def _shown(word: str) -> str:
    """A word as a refusal quotes it: bounded, so a refusal (and its journal entry) stays short."""
    return repr(word if len(word) <= 60 else word[:57] + "...")


def program_name(word: str) -> str:
    """`/usr/bin/python3.12` -> `python`; `base64` stays `base64` (a listed name wins)."""
    base = word.rsplit("/", 1)[-1]
    if base in ENCODERS or base in INTERPRETERS:
        return base
    stripped = base.rstrip("0123456789.")  # linear, unlike a `[0-9.]+$` search
    return stripped if stripped else base


def _is_operator(token: str) -> bool:
    return bool(token) and all(char in _OPERATOR_CHARS for char in token)


def _script_tokens(text: str) -> list[str]:
    """A shell script's words and operators; `$(` and backquotes open a new command."""
    # A backslash-newline is removed before anything else (POSIX 2.2.1). A substitution
    # leaves a mark, so that a quoted word that held one ("$(env)") is read again.
    opened = text.replace("\\\n", "")
    for opener in ("$(", "`"):
        opened = opened.replace(opener, f" ; {_OPENED} ")
    lexer = shlex.shlex(opened, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""  # a `#` inside a word is not a comment to us: read everything
    return [token for token in lexer if token != _OPENED]


def _crude_tokens(text: str) -> list[str]:
    """What an unreadable script could mean: quotes and backslashes dropped, split on blanks
    and operators (over-approximates the words a shell would see)."""
    flat = text.replace("'", "").replace('"', "").replace("\\", "")
    return [word for word in _CRUDE_SPLIT.split(flat.replace("$(", " ")) if word]


def _simple_commands(tokens: list[str]) -> list[list[str]]:
    """Tokens cut at control operators; redirections stay inside the command they belong to
    (the operator dropped, its target kept as an argument; an input redirection, here-document,
    here-string or process substitution also leaves `/dev/stdin`, so that a program reading
    its code from it is seen to: `python3 <<< "..."`, `python3 <(...)`)."""
    commands: list[list[str]] = [[]]
    for token in tokens:
        if _is_operator(token):
            if _REDIRECT.search(token):  # >, <, >>, 2>&1's >&, <<<, <(: a redirection
                if "<" in token:
                    commands[-1].append(STDIN)
                continue
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def _short_flags(word: str) -> str:
    return word[1:] if len(word) > 1 and word[0] == "-" and word[1] != "-" else ""


def _has_flag(words: list[str], letter: str, long: tuple[str, ...]) -> bool:
    for word in words:
        if word.startswith(long) and long:
            return True
        flags = _short_flags(word)
        if letter in flags:
            return True
        if letter == "c" and re.fullmatch(r"-?[0-9]+c", word):  # head -10c (obsolete form)
            return True
    return False


def _is_inline_interpreter(rest: list[str]) -> bool:
    """Code on the command line (-c, -e, -E, -p, -r, --eval...) or on stdin (no script file
    named): the code is text this rule does not read, and it can read the environment."""
    for word in rest:
        if word.startswith(_INLINE_LONG) or set(_short_flags(word)) & _INLINE_FLAGS:
            return True
        if _is_stdin(word) or word == "eval":  # `deno eval '...'`
            return True
    named_file = any(word and not word.startswith("-") for word in rest)
    return not named_file


def _is_stdin(word: str) -> bool:
    return word in ("-", STDIN) or word.startswith(("/dev/fd/", "/proc/self/fd/"))


def _reads_stdin(rest: list[str]) -> bool:
    """A shell with neither `-c` nor a script file (or with `-s`): its commands come from
    stdin, which this rule cannot read (`echo ZW52 | base64 -d | sh`)."""
    for word in rest:
        flags = _short_flags(word)
        if "s" in flags or _is_stdin(word):
            return True
        if "c" in flags or word in ("--command",):
            return False
        if word and not word.startswith(("-", "+")):
            return False  # a script file
    return True


def _printf_transforms(rest: list[str]) -> bool:
    return any(re.search(r"%(?![sb%])", word) for word in rest)


def _json_query_transforms(rest: list[str]) -> bool:
    for word in rest:
        if word.startswith("-"):
            if word.startswith(("--arg", "--rawfile", "--slurpfile", "--from-file", "--jsonargs")):
                return True
            if "f" in _short_flags(word) or "L" in _short_flags(word):
                return True  # the program from a file: not readable here
            continue
        if not _PATH_CHARS.fullmatch(word) or _BARE_NAME.search(word):
            return True
    return False


class _Reader:
    def __init__(self, findings: _Findings) -> None:
        self.f = findings

    def word_sources(self, word: str, script: bool) -> None:
        f = self.f
        lowered = word.lower()
        if script and ("$" in word or "`" in word):
            f.found_source(f"the expansion {_shown(word)} (the environment holds the value)")
        if script and _GLOB.search(word):
            f.found_source(f"the glob {_shown(word)} (it may name a file that holds a secret)")
        if script and "{" in word and ("," in word or ".." in word):
            f.found_source(f"the brace expansion {_shown(word)} (it may name such a file)")
        for fragment in SOURCE_FRAGMENTS:
            if fragment in lowered:
                f.found_source(f"{_shown(word)} (the environment of a process)")
        if lowered == "proc" or lowered.startswith("proc/"):
            f.found_source(f"{_shown(word)} (the environment of a process)")
        for pattern in f.variables:
            if pattern.search(word):
                f.found_source(f"{_shown(word)} (the credential's variable)")
        # Also inside an option or a program's own script: `tar --to-command=env`,
        # `sed '1e env'`, `find -exec env`.
        if any(program_name(part) in DUMPERS for part in _PARTS.split(word)):
            f.found_source(f"{_shown(word)} (it prints the environment)")
        for name in f.path_names:
            if name in lowered:
                f.found_source(f"{_shown(word)} (a file that holds a secret)")

    def command(self, words: list[str], script: bool) -> None:
        f = self.f
        index = 0
        while index < len(words) and (
            words[index] in _RESERVED or (script and _ASSIGNMENT.match(words[index]))
        ):
            if script and words[index].startswith("IFS"):
                f.found_encoder("an IFS assignment (it cuts the value into pieces)")
            index += 1
        if index < len(words) and script:
            head = words[index]
            rest = words[index + 1 :]
            if "$" in head or "{" in head or _GLOB.search(head):
                f.found_encoder(f"the command {_shown(head)} (named by an expansion)")
            if head in SHELL_TRANSFORMS:
                f.found_encoder(f"the shell's {_shown(head)}")
            if head in CODE_RUNNERS:
                f.found_source(f"the shell's {_shown(head)} (it runs code this rule cannot read)")
            if head in BARE_DUMPERS and all(word == "-p" for word in rest):
                f.found_source(f"{_shown(head)} (it prints the variables)")
        for word in words:
            if script and _EXPANSION_OPERATOR.search(word):
                f.found_encoder(f"the expansion {_shown(word)} (the shell transforms the value)")
            # A path to an encoder anywhere: it may be copied or linked under another name
            # (`ln -s /usr/bin/xxd q; ./q ...`).
            if "/" in word and program_name(word) in ENCODERS | INTERPRETERS:
                f.found_encoder(f"{_shown(word)} (a path to an encoder)")
        # The program is the command word; behind a wrapper (`timeout 5 xxd`, `find -exec od`)
        # any later word may be one, so all of them are taken as programs.
        candidates = words[index:]
        if candidates and program_name(candidates[0]) not in WRAPPERS:
            candidates = candidates[:1]
        for position, word in enumerate(candidates):
            name = program_name(word)
            rest = words[index + position + 1 :]
            if name in ENCODERS:
                f.found_encoder(repr(name))
            elif name in INTERPRETERS:
                f.found_encoder(f"{name!r} (an interpreter)")
                if name in AWKS or _is_inline_interpreter(rest):
                    f.found_source(f"{name!r} given code inline (it reads the environment)")
            elif name in SHELLS and _reads_stdin(rest):
                f.found_source(f"{name!r} reading commands from stdin (they are not read here)")
            elif name in BYTE_SLICERS and _has_flag(rest, "c", ("--bytes",)):
                f.found_encoder(f"{name!r} with a byte count")
            elif name in MATCH_PRINTERS and _has_flag(rest, "o", ("--only-matching",)):
                f.found_encoder(f"{name!r} -o")
            elif name == "printf" and _printf_transforms(rest):
                f.found_encoder("'printf' with a conversion other than %s")
            elif name in JSON_QUERIES and _json_query_transforms(rest):
                f.found_encoder(f"{name!r} with more than a path expression")

    def piece(self, tokens: list[str], script: bool, depth: int, *, reread: bool = True) -> None:
        commands = _simple_commands(tokens) if script else [tokens]
        # A word is a script where something in this piece runs one (a shell's -c, ssh...);
        # a command substitution is one wherever a shell reads it (POSIX 2.6.3).
        runs_scripts = any(program_name(word) in SCRIPT_RUNNERS for word in tokens)
        for words in commands:
            self.command(words, script)
            for word in words:
                self.word_sources(word, script)
                if not reread:
                    continue
                if (runs_scripts and _SHELL_SYNTAX.search(word)) or (
                    script and (_OPENED in word or "$(" in word or "`" in word)
                ):
                    self.script(word, depth + 1)

    def script(self, text: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.f.unreadable = self.f.unreadable or "scripts nested too deep"
            self.piece(_crude_tokens(text), True, depth, reread=False)
            return
        try:
            tokens = _script_tokens(text)
        except ValueError as exc:  # shlex: no closing quotation, no escaped character
            self.f.unreadable = self.f.unreadable or f"{text[:60]!r}: {exc}"
            self.piece(_crude_tokens(text), True, depth, reread=False)
            return
        # A word that opens into itself has nothing more to read inside it.
        self.piece(tokens, True, depth, reread=tokens != [text])


def check_secret_encoding(argv: tuple[str, ...] | list[str], sources: SecretSources) -> None:
    """KeeperRefused if the command reads a secret source through an encoder (module doc)."""
    findings = _Findings(sources, sources.patterns(), sources.path_names())
    _Reader(findings).piece(list(argv), False, 0)
    if findings.source is not None and findings.encoder is not None:
        raise KeeperRefused(
            f"command reads a secret ({findings.source}) through an encoder "
            f"({findings.encoder}); run encoders on the keeper's output yourself, outside it",
            rule=RULE_SECRET_THROUGH_ENCODER,
        )
    if findings.unreadable is not None and (findings.source or findings.encoder):
        raise KeeperRefused(
            f"command holds a script that cannot be read ({findings.unreadable}) next to "
            f"{findings.source or findings.encoder}",
            rule=RULE_UNREADABLE_SCRIPT,
        )
