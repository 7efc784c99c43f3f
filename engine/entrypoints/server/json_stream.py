"""One JSON value (RFC 8259) checked a character at a time, for the streaming tool-call parsers.

``JsonScanner(first)`` takes a JSON object (``first="{"``) or string (``first='"'``) and nothing
else at the top level. ``push(ch)`` returns ``None`` when ``ch`` cannot continue a valid JSON text
(the scanner is then spent: push nothing more), ``""`` for whitespace between tokens and ``ch``
for every other character, so the concatenated returns are the value with the whitespace between
its tokens removed. ``done`` turns true with the character that completes the value. It accepts
exactly what ``json.loads`` accepts, less ``NaN`` and ``Infinity`` (not JSON). Each character
costs O(1): the scanner keeps only the open containers and the state of the current token.
"""
from __future__ import annotations

WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# a number's states: state -> (characters, next state) pairs; the states in _NUMBER_ENDS may end it
_NUMBER = {
    "-": (("0", "0"), ("123456789", "int")),
    "0": ((".", "."), ("eE", "e")),
    "int": ((_DIGITS, "int"), (".", "."), ("eE", "e")),
    ".": ((_DIGITS, "frac"),),
    "frac": ((_DIGITS, "frac"), ("eE", "e")),
    "e": (("+-", "sign"), (_DIGITS, "exp")),
    "sign": ((_DIGITS, "exp"),),
    "exp": ((_DIGITS, "exp"),),
}
_NUMBER_ENDS = {"0", "int", "frac", "exp"}
# what comes next outside strings, numbers and literals
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)


class JsonScanner:
    """A JSON object or string fed a character at a time (see the module docstring)."""

    def __init__(self, first: str):
        assert first in '{"'
        self.done = False
        self._first = first           # the top-level value's first character, until it is seen
        self._stack: list[str] = []   # open containers, "{" or "["
        self._expect = _VALUE
        self._string = False          # inside a string
        self._key = False             # that string is an object key
        self._escape = 0              # -1 after a backslash, 1..4 hex digits of a \u escape left
        self._number = ""             # the number's state while inside one
        self._literal = ""            # the rest of true / false / null while inside one

    def push(self, ch: str) -> str | None:
        if self.done:
            return None
        if self._string:
            return self._string_char(ch)
        if self._literal:
            if ch != self._literal[0]:
                return None
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_ended()
            return ch
        if self._number:
            nxt = next((state for chars, state in _NUMBER[self._number] if ch in chars), None)
            if nxt is not None:
                self._number = nxt
                return ch
            if self._number not in _NUMBER_ENDS:
                return None
            self._number = ""
            self._value_ended()  # a number is never the top-level value: ch follows it in its container
        return self._structure(ch)

    def _structure(self, ch: str) -> str | None:
        if ch in WS:
            return ""
        expect = self._expect
        if expect == _COLON:
            if ch != ":":
                return None
            self._expect = _VALUE
        elif expect == _COMMA_OR_CLOSE:
            if ch == ",":
                self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            elif ch == ("}" if self._stack[-1] == "{" else "]"):
                self._close()
            else:
                return None
        elif expect in (_KEY, _KEY_OR_CLOSE):
            if ch == '"':
                self._string = self._key = True
            elif expect == _KEY_OR_CLOSE and ch == "}":
                self._close()
            else:
                return None
        elif expect == _VALUE_OR_CLOSE and ch == "]":
            self._close()
        else:
            return self._value_start(ch)
        return ch

    def _value_start(self, ch: str) -> str | None:
        if self._first:
            if ch != self._first:
                return None
            self._first = ""
        if ch in "{[":
            self._stack.append(ch)
            self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self._string, self._key = True, False
        elif ch == "-" or ch in _DIGITS:
            self._number = "-" if ch == "-" else "0" if ch == "0" else "int"
        elif ch in _LITERALS:
            self._literal = _LITERALS[ch]
        else:
            return None
        return ch

    def _string_char(self, ch: str) -> str | None:
        if self._escape == -1:
            if ch not in _ESCAPES:
                return None
            self._escape = 4 if ch == "u" else 0
        elif self._escape:
            if ch not in _HEX:
                return None
            self._escape -= 1
        elif ch == "\\":
            self._escape = -1
        elif ch == '"':
            self._string = False
            if self._key:
                self._expect = _COLON
            else:
                self._value_ended()
        elif ch < " ":
            return None
        return ch

    def _close(self) -> None:
        self._stack.pop()
        self._value_ended()

    def _value_ended(self) -> None:
        if self._stack:
            self._expect = _COMMA_OR_CLOSE
        else:
            self.done = True
