"""Text of a completion as its tokens arrive: incremental decoding and stop strings.

Pure Python on the tokenizer (no MLX): the HTTP side runs it per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["CompletionText", "IncrementalDecoder"]

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decode a token stream piece by piece, never splitting a UTF-8 character.

    Each new token is decoded together with a few tokens before it (the prefix window), so
    tokenizers whose decoding of a token depends on its neighbours (SentencePiece's leading
    space, byte fallback) give the same text as decoding the whole stream; a piece is held
    back while it ends in U+FFFD (an incomplete multi-byte character). Cost per token is two
    decodes of a short window, not of the whole stream.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens))) if tokens else ""

    def push(self, token: int) -> str:
        """Add a token; return the text it completes (possibly empty)."""
        self._tokens.append(int(token))
        before = self._decode(self._tokens[self._prefix : self._read])
        text = self._decode(self._tokens[self._prefix :])
        if len(text) > len(before) and not text.endswith(_REPLACEMENT):
            piece = text[len(before) :]
            self._prefix = self._read
            self._read = len(self._tokens)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream."""
        before = self._decode(self._tokens[self._prefix : self._read])
        text = self._decode(self._tokens[self._prefix :])
        self._prefix = self._read = len(self._tokens)
        return text[len(before) :]


class CompletionText:
    """The text of one completion: decoded pieces, end-of-sequence tokens, stop strings.

    :meth:`push` takes the tokens of an engine step and returns the text that can be sent
    now. End-of-sequence tokens (``eos_ids``) are counted but give no text. A ``stop`` string
    is matched on the decoded text across token boundaries; the text ends just before its
    first occurrence (the stop string is not included), :attr:`stopped` becomes True and
    :attr:`completion_tokens` counts the tokens up to the one that completed the match.
    While the text ends in what could be the start of a stop string, that tail is held back.
    """

    def __init__(self, tokenizer: Any, *, stop: Iterable[str] = (), eos_ids: Iterable[int] = ()):
        self._decoder = IncrementalDecoder(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._eos = frozenset(int(i) for i in eos_ids)
        self._text = ""
        self._sent = 0
        self._searched = 0
        self.tokens: list[int] = []
        self.stopped = False

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for this completion (end-of-sequence token included)."""
        return len(self.tokens)

    @property
    def text(self) -> str:
        """The completion's text so far (a matched stop string cut off)."""
        return self._text

    def push(self, tokens: Iterable[int]) -> str:
        """Take the tokens of one step; return the text that is safe to send now."""
        for token in tokens:
            if self.stopped:
                break
            self.tokens.append(int(token))
            if int(token) in self._eos:
                continue
            self._add(self._decoder.push(token))
        return self._ready(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text at the end of the stream (held-back pieces included)."""
        if not self.stopped:
            self._add(self._decoder.flush())
        return self._ready(final=True)

    def _add(self, piece: str) -> None:
        if not piece:
            return
        self._text += piece
        if not self._stop:
            return
        start = max(0, self._searched - self._longest + 1)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True
        self._searched = len(self._text)

    def _held(self) -> int:
        """Length of the longest tail of the text that starts some stop string."""
        text = self._text
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _ready(self, *, final: bool) -> str:
        end = len(self._text) if final else len(self._text) - self._held()
        if end <= self._sent:
            return ""
        piece = self._text[self._sent : end]
        self._sent = end
        return piece
