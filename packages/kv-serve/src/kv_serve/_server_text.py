"""Text of a completion as its tokens arrive: incremental decoding, stop strings, logprobs.

Pure Python on the tokenizer (no MLX): the HTTP side runs it per request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

__all__ = [
    "CompletionText",
    "IncrementalDecoder",
    "LogprobEntry",
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "finite_logprob",
]

_REPLACEMENT = "\ufffd"
#: What OpenAI reports for a log-probability too small to say (JSON has no -Infinity).
LOGPROB_FLOOR = -9999.0


class IncrementalDecoder:
    """Decode a token stream piece by piece, never splitting a UTF-8 character.

    Each new token is decoded together with a few tokens before it (the prefix window), so
    tokenizers whose decoding of a token depends on its neighbours (SentencePiece's leading
    space, byte fallback) give the same text as decoding the whole stream; a piece is held
    back while it ends in U+FFFD (an incomplete multi-byte character). Cost per token is two
    decodes of a short window, not of the whole stream.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._kwargs = {"skip_special_tokens": True} if skip_special_tokens else {}
        self._tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens), **self._kwargs)) if tokens else ""

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
    is matched on the decoded text across token boundaries, once ``min_tokens`` tokens were
    generated; the text ends just before its first occurrence (the stop string is not
    included), :attr:`stopped` becomes True and :attr:`completion_tokens` counts the tokens
    up to the one that completed the match. While the text ends in what could be the start
    of a stop string, that tail is held back.

    Per token it keeps :attr:`pieces` (the text the token added: they join to the text
    before any cut, so a character split over tokens belongs to the token that completed
    it), :attr:`offsets` (where that text starts) and, given ``texts``, :attr:`raw` (the
    token's own bytes: they join to the UTF-8 of the text, or, where the tokens are no valid
    UTF-8, to bytes that decode to the text with U+FFFD for each invalid sequence).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Iterable[str] = (),
        eos_ids: Iterable[int] = (),
        min_tokens: int = 0,
        texts: TokenTexts | None = None,
    ):
        self._decoder = IncrementalDecoder(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._eos = frozenset(int(i) for i in eos_ids)
        self._min_tokens = min_tokens
        self._texts = texts
        self._pending = b""
        self._text = ""
        self._sent = 0
        self._searched = 0
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.offsets: list[int] = []
        self.raw: list[bytes] = []
        self.stopped = False
        #: The stop string that ended the text (``None`` until one does).
        self.stop_string: str | None = None

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
            token = int(token)
            self.tokens.append(token)
            self.offsets.append(len(self._text))
            piece = "" if token in self._eos else self._decoder.push(token)
            self.pieces.append(piece)
            if self._texts is not None:
                self.raw.append(self._raw(token, piece))
            self._add(piece)
        return self._ready(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text at the end of the stream (held-back pieces included)."""
        if not self.stopped:
            tail = self._decoder.flush()
            if tail and self.pieces:
                self.pieces[-1] += tail
            self._add(tail)
        return self._ready(final=True)

    def _raw(self, token: int, piece: str) -> bytes:
        assert self._texts is not None
        if token in self._eos:
            return b""
        if not piece:  # the first bytes of a character a later token completes
            raw = self._texts.raw(token)
            self._pending += raw
            return raw
        full = piece.encode()
        pending, self._pending = self._pending, b""
        if not pending:
            return full
        if full.startswith(pending):  # the character the pending bytes began
            return full[len(pending) :]
        # The pending bytes were no character (shown as U+FFFD): this token's own bytes.
        return self._texts.raw(token)

    def _add(self, piece: str) -> None:
        if not piece:
            return
        self._text += piece
        if not self._stop:
            return
        if len(self.tokens) >= self._min_tokens:
            start = max(0, self._searched - self._longest + 1)
            hits = [(self._text.find(s, start), s) for s in self._stop]
            found = [(i, s) for i, s in hits if i >= 0]
            if found:
                at, self.stop_string = min(found)
                self._text = self._text[:at]
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


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme), character -> byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Each vocabulary token's own text and bytes, for the alternatives of a logprob.

    :meth:`raw` is the token's bytes: its decoding where that is whole UTF-8, else the bytes
    its vocabulary entry stands for (SentencePiece's ``<0xNN>`` byte tokens, byte-level
    BPE's byte alphabet). :meth:`text` is those bytes as text, or, where they are not whole
    UTF-8 (part of a character), ``bytes:`` and their escapes, as OpenAI writes such tokens.
    Lookups are cached (at most ``cache_size`` tokens).
    """

    def __init__(self, tokenizer: Any, *, cache_size: int = 65536) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._cache_size = cache_size

    def raw(self, token: int) -> bytes:
        """The token's own bytes."""
        return self._lookup(token)[1]

    def text(self, token: int) -> str:
        """The token's own text (``bytes:`` and byte escapes for part of a character)."""
        return self._lookup(token)[0]

    def _lookup(self, token: int) -> tuple[str, bytes]:
        found = self._cache.get(token)
        if found is not None:
            return found
        decoded = str(self._tokenizer.decode([token]))
        raw = decoded.encode()
        if _REPLACEMENT in decoded:
            raw = self._vocab_bytes(token) or raw
        try:
            shown = raw.decode("utf-8")
        except UnicodeDecodeError:
            shown = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[token] = (shown, raw)
        return shown, raw

    def _vocab_bytes(self, token: int) -> bytes | None:
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token) if convert is not None else None
        if not isinstance(piece, str) or not piece:
            return None
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None


class LogprobEntry(Protocol):
    """One token's log-probabilities (``kv_batching.TokenLogprob`` is one)."""

    @property
    def token(self) -> int:
        """The token's id."""

    @property
    def logprob(self) -> float:
        """Its log-probability."""

    @property
    def top(self) -> Sequence[tuple[int, float]]:
        """The most likely tokens and their log-probabilities, most likely first."""


def finite_logprob(value: float) -> float:
    """``value``, or OpenAI's -9999.0 for what JSON cannot hold (-inf, nan)."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def completion_logprobs(
    tokens: Sequence[str],
    offsets: Sequence[int],
    entries: Sequence[LogprobEntry | None],
    texts: TokenTexts,
    k: int,
) -> dict[str, list[Any]]:
    """A completions choice's ``logprobs`` (OpenAI's legacy shape) for tokens and entries.

    ``tokens`` and ``offsets`` come from :class:`CompletionText` (``pieces``, ``offsets``);
    an entry ``None`` (a prompt's first token) has no logprob and no ``top_logprobs``. Each
    ``top_logprobs`` maps the ``k`` most likely tokens' own texts to their logprobs, plus
    the chosen token's (so ``k`` or ``k + 1`` entries, fewer where two texts coincide).
    """
    top: list[dict[str, float] | None] = []
    chosen: list[float | None] = []
    for entry in entries:
        if entry is None:
            top.append(None)
            chosen.append(None)
            continue
        alternatives = {texts.text(t): finite_logprob(lp) for t, lp in entry.top[:k]}
        alternatives.setdefault(texts.text(entry.token), finite_logprob(entry.logprob))
        top.append(alternatives)
        chosen.append(finite_logprob(entry.logprob))
    return {
        "tokens": list(tokens),
        "token_logprobs": chosen,
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


def chat_logprobs(
    tokens: Sequence[str],
    raw: Sequence[bytes],
    entries: Sequence[LogprobEntry],
    texts: TokenTexts,
    k: int,
) -> list[dict[str, Any]]:
    """A chat choice's ``logprobs.content``: one object per token with its ``k`` alternatives.

    ``tokens`` and ``raw`` come from :class:`CompletionText` (``pieces``, ``raw``).
    """
    return [
        {
            "token": token,
            "logprob": finite_logprob(entry.logprob),
            "bytes": list(data),
            "top_logprobs": [
                {"token": texts.text(t), "logprob": finite_logprob(lp), "bytes": list(texts.raw(t))}
                for t, lp in entry.top[:k]
            ],
        }
        for token, data, entry in zip(tokens, raw, entries, strict=True)
    ]
