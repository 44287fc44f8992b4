"""A tiny decoder-only transformer in pure NumPy, for demos and verification.

The model exists so that ``python -m kvcore demo`` can run real attention
through a KV cache and check the result against a full recompute. It has
random weights, so its text is meaningless, but its arithmetic is that of a
modern decoder (Llama-style): RMSNorm before each block, rotary position
embeddings (RoPE), grouped-query attention (GQA), a SwiGLU MLP and an untied
language-model head. All math is float32.

The forward pass is split into pieces so any KV cache can sit between them::

    x = model.embed(token_ids)
    for layer in range(config.num_layers):
        q, k, v = model.layer_qkv(layer, x, positions)
        # store k, v in the cache, then read every position back
        k_all, v_all = ...                      # (num_kv_heads, kv_len, head_dim)
        attn = model.attention(q, k_all, v_all, positions, kv_len)
        x = model.layer_finish(layer, x, attn)
    logits = model.logits(x)

:meth:`TinyTransformer.forward_full` runs the same pieces without any cache
and is the reference that cached decoding is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# RoPE table rows a model computes when it is made (it adds rows on demand)
_ROPE_ROWS = 8192

__all__ = ["ModelConfig", "LlamaDecoder", "TinyTransformer", "NumpyContiguousCache"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of :class:`TinyTransformer`.

    Parameters
    ----------
    vocab_size : int
        Number of token ids; valid ids are ``0 .. vocab_size - 1``.
    num_layers : int
        Number of decoder blocks.
    num_heads : int
        Number of query heads.
    num_kv_heads : int
        Number of key/value heads; must divide ``num_heads`` (grouped-query
        attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
    head_dim : int
        Size of one attention head; must be even (RoPE rotates pairs).
    ffn_hidden : int
        Inner size of the SwiGLU MLP.
    rope_theta : float
        RoPE base frequency.
    rms_eps : float
        Epsilon of RMSNorm.
    max_position : int
        Largest number of positions the model accepts (positions
        ``0 .. max_position - 1``).
    rope_scaling : float
        Linear RoPE scaling factor (position interpolation): the angle of
        position ``p`` is that of ``p / rope_scaling``; 1.0 is plain RoPE.
    """

    vocab_size: int = 512
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_hidden: int = 1024
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 4096
    rope_scaling: float = 1.0

    @property
    def hidden(self) -> int:
        """Model width, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_hidden", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                f"got {self.num_kv_heads}")
        if not (isinstance(self.rope_scaling, (int, float, np.floating))
                and self.rope_scaling > 0):
            raise ValueError(f"ModelConfig.rope_scaling: expected a positive number, "
                             f"got {self.rope_scaling!r}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim: expected an even number, got {self.head_dim}")


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # Mean of squares in float32 is fine at these widths (512); no float64 needed.
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * scale) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    # sigmoid written through tanh: exp(-x) would overflow (and warn) for very
    # negative x, tanh never does.
    return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))


class LlamaDecoder:
    """A Llama-style decoder in float32 NumPy, from given weights.

    The arithmetic of :class:`TinyTransformer` (random weights) and of a real
    Llama-family checkpoint (:func:`kvcore.cli.llama.load_gguf`): RMSNorm,
    rotary embeddings in the rotate-half layout, grouped-query attention,
    SwiGLU.  Every matrix is ``(fan_in, fan_out)``: a projection is ``x @ w``.

    Parameters
    ----------
    config : ModelConfig
        Model shape.
    embedding : numpy.ndarray, float32, shape (vocab_size, hidden)
    layers : list of dict
        One dict per block with ``attn_norm``, ``wq``, ``wk``, ``wv``, ``wo``,
        ``mlp_norm``, ``w_gate``, ``w_up``, ``w_down``.
    final_norm : numpy.ndarray, float32, shape (hidden,)
    lm_head : numpy.ndarray, float32, shape (hidden, vocab_size)
        May be a view of ``embedding.T`` (tied embeddings).
    """

    def __init__(self, config: ModelConfig, embedding: np.ndarray, layers: list,
                 final_norm: np.ndarray, lm_head: np.ndarray) -> None:
        self.config = cfg = config
        self.embedding = embedding
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        if len(layers) != cfg.num_layers:
            raise ValueError(f"layers: expected {cfg.num_layers} blocks, got {len(layers)}")
        # RoPE tables, computed in float64 so large positions keep their
        # accuracy, then stored as float32.  Linear scaling (position
        # interpolation) divides the positions by its factor.  The first
        # _ROPE_ROWS positions now, more when a forward reaches them: a model
        # file's context length (up to 2**32 - 1) costs nothing until used.
        half = cfg.head_dim // 2
        self._inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0
                                            / cfg.head_dim)
        self._rope_tables = self._rope_rows(min(cfg.max_position, _ROPE_ROWS))

    def _rope_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The (cos, sin) tables of positions ``0 .. n - 1``, float32 ``(n, head_dim / 2)``."""
        positions = np.arange(n, dtype=np.float64) / self.config.rope_scaling
        angles = positions[:, None] * self._inv_freq[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    @property
    def _rope_cos(self) -> np.ndarray:
        return self._rope_tables[0]

    @property
    def _rope_sin(self) -> np.ndarray:
        return self._rope_tables[1]

    # ------------------------------------------------------------------ checks

    def _check_tokens(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise TypeError(
                f"token_ids: expected a 1-D sequence of ints, got array of dtype {ids.dtype} "
                f"and shape {ids.shape}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token_ids: expected ids in 0..{self.config.vocab_size - 1}, "
                f"got values in {ids.min()}..{ids.max()}")
        return ids

    def _check_positions(self, positions, n: int) -> np.ndarray:
        pos = np.asarray(positions)
        if pos.ndim == 0:
            # A scalar is the start of a run of consecutive positions.
            pos = int(pos) + np.arange(n, dtype=np.int64)
        if pos.shape != (n,):
            raise ValueError(f"positions: expected shape ({n},), got {pos.shape}")
        pos = pos.astype(np.int64, copy=False)
        if n and (pos.min() < 0 or pos.max() >= self.config.max_position):
            raise ValueError(
                f"positions: expected values in 0..{self.config.max_position - 1}, "
                f"got values in {pos.min()}..{pos.max()}")
        return pos

    def _check_layer(self, layer) -> dict:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.config.num_layers:
            raise IndexError(
                f"layer: expected an int in 0..{self.config.num_layers - 1}, got {layer!r}")
        return self.layers[int(layer)]

    # ------------------------------------------------------------------ pieces

    def embed(self, token_ids) -> np.ndarray:
        """Look up token embeddings.

        Parameters
        ----------
        token_ids : array_like of int, shape (n,)

        Returns
        -------
        numpy.ndarray
            float32, shape ``(n, hidden)``; a new array (the residual stream).
        """
        ids = self._check_tokens(token_ids)
        return self.embedding[ids]

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # Rotate-half (GPT-NeoX) layout: dimension i pairs with i + head_dim/2.
        half = x.shape[-1] // 2
        tables = self._rope_tables      # (one pair: another thread may grow them meanwhile)
        if positions.size and positions.max() >= len(tables[0]):
            tables = self._rope_tables = self._rope_rows(
                min(self.config.max_position, max(2 * len(tables[0]), int(positions.max()) + 1)))
        cos = tables[0][positions][:, None, :]
        sin = tables[1][positions][:, None, :]
        x1 = x[..., :half]
        x2 = x[..., half:]
        return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)

    def layer_qkv(self, layer: int, x: np.ndarray, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Project the residual stream to queries, keys and values.

        Parameters
        ----------
        layer : int
            Decoder block index.
        x : numpy.ndarray, shape (n, hidden)
            Residual stream for ``n`` tokens.
        positions : array_like of int, shape (n,), or int
            Absolute position of each token (an int means ``start, start+1, ...``).

        Returns
        -------
        q : numpy.ndarray, float32, shape (n, num_heads, head_dim)
        k : numpy.ndarray, float32, shape (n, num_kv_heads, head_dim)
        v : numpy.ndarray, float32, shape (n, num_kv_heads, head_dim)
            RoPE is already applied to ``q`` and ``k``; ``k`` and ``v`` are
            token-major, as a KV cache's ``append``/``write`` takes them.
        """
        cfg = self.config
        w = self._check_layer(layer)
        x = np.asarray(x, dtype=np.float32)
        n = x.shape[0]
        pos = self._check_positions(positions, n)
        h = _rms_norm(x, w["attn_norm"], cfg.rms_eps)
        q = (h @ w["wq"]).reshape(n, cfg.num_heads, cfg.head_dim)
        k = (h @ w["wk"]).reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ w["wv"]).reshape(n, cfg.num_kv_heads, cfg.head_dim)
        return self._rope(q, pos), self._rope(k, pos), np.ascontiguousarray(v)

    def attention(self, q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray,
                  q_positions, kv_len: int | None = None) -> np.ndarray:
        """Causal grouped-query attention of ``n`` queries over a KV history.

        Parameters
        ----------
        q : numpy.ndarray, shape (n, num_heads, head_dim)
            Queries from :meth:`layer_qkv`.
        k_all, v_all : numpy.ndarray, shape (num_kv_heads, L, head_dim)
            Keys and values of positions ``0 .. L-1``, head-major (what
            ``kvcore.PagedKVCache.gather(layer, dtype="float32")`` returns).
            Any float dtype; it is widened to float32.
        q_positions : array_like of int, shape (n,), or int
            Absolute position of each query. A query at position ``p`` sees
            keys ``0 .. p`` only.
        kv_len : int, optional
            Number of leading positions of ``k_all``/``v_all`` to use
            (default: all ``L``).

        Returns
        -------
        numpy.ndarray
            float32, shape ``(n, num_heads, head_dim)``.
        """
        cfg = self.config
        q = np.asarray(q, dtype=np.float32)
        k_all = np.asarray(k_all, dtype=np.float32)
        v_all = np.asarray(v_all, dtype=np.float32)
        n = q.shape[0]
        if q.shape[1:] != (cfg.num_heads, cfg.head_dim):
            raise ValueError(
                f"q: expected shape (n, {cfg.num_heads}, {cfg.head_dim}), got {q.shape}")
        for name, arr in (("k_all", k_all), ("v_all", v_all)):
            if arr.ndim != 3 or arr.shape[0] != cfg.num_kv_heads or arr.shape[2] != cfg.head_dim:
                raise ValueError(
                    f"{name}: expected shape ({cfg.num_kv_heads}, kv_len, {cfg.head_dim}), "
                    f"got {arr.shape}")
        if k_all.shape[1] != v_all.shape[1]:
            raise ValueError(f"v_all: expected {k_all.shape[1]} positions like k_all, got {v_all.shape[1]}")
        if kv_len is None:
            kv_len = k_all.shape[1]
        if not 0 <= kv_len <= k_all.shape[1]:
            raise ValueError(f"kv_len: expected 0..{k_all.shape[1]}, got {kv_len}")
        pos = self._check_positions(q_positions, n)
        if n and pos.max() >= kv_len:
            # Otherwise a query would silently attend to fewer keys than its
            # position says, which hides a cache that lost positions.
            raise ValueError(
                f"q_positions: a query at position {pos.max()} needs kv_len > {pos.max()}, "
                f"got kv_len={kv_len}")
        k_all = k_all[:, :kv_len]
        v_all = v_all[:, :kv_len]

        group = cfg.num_heads // cfg.num_kv_heads
        # (n, H, D) -> (KV, group*n, D): query head h = kv*group + g reads KV
        # head kv, and stacking the group lets one batched matmul per KV head
        # do the work instead of repeating K/V group times.
        qg = q.transpose(1, 0, 2).reshape(cfg.num_kv_heads, group * n, cfg.head_dim)
        scores = qg @ k_all.transpose(0, 2, 1)
        scores *= np.float32(1.0 / np.sqrt(cfg.head_dim))
        scores = scores.reshape(cfg.num_kv_heads, group, n, kv_len)
        visible = np.arange(kv_len)[None, :] <= pos[:, None]          # (n, kv_len)
        scores = np.where(visible, scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = probs.reshape(cfg.num_kv_heads, group * n, kv_len) @ v_all
        return out.reshape(cfg.num_heads, n, cfg.head_dim).transpose(1, 0, 2)

    def layer_finish(self, layer: int, x: np.ndarray, attn_out: np.ndarray) -> np.ndarray:
        """Finish a decoder block: output projection, residual, MLP, residual.

        Parameters
        ----------
        layer : int
            Decoder block index.
        x : numpy.ndarray, shape (n, hidden)
            Residual stream that went into :meth:`layer_qkv`.
        attn_out : numpy.ndarray, shape (n, num_heads, head_dim) or (n, hidden)
            Output of :meth:`attention`.

        Returns
        -------
        numpy.ndarray
            float32, shape ``(n, hidden)``: the residual stream for the next block.
        """
        cfg = self.config
        w = self._check_layer(layer)
        x = np.asarray(x, dtype=np.float32)
        n = x.shape[0]
        attn = np.asarray(attn_out, dtype=np.float32).reshape(n, cfg.hidden)
        x = x + attn @ w["wo"]
        h = _rms_norm(x, w["mlp_norm"], cfg.rms_eps)
        return x + (_silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and LM head.

        Parameters
        ----------
        x : numpy.ndarray, shape (n, hidden)

        Returns
        -------
        numpy.ndarray
            float32, shape ``(n, vocab_size)``.
        """
        x = np.asarray(x, dtype=np.float32)
        return _rms_norm(x, self.final_norm, self.config.rms_eps) @ self.lm_head

    # ------------------------------------------------------------------ drivers

    def forward_full(self, token_ids) -> np.ndarray:
        """Run the whole sequence with no cache (the reference result).

        Parameters
        ----------
        token_ids : array_like of int, shape (n,)
            Tokens at positions ``0 .. n-1``.

        Returns
        -------
        numpy.ndarray
            float32 logits, shape ``(n, vocab_size)``; row ``i`` predicts token ``i + 1``.
        """
        return self.logits(self._final_stream(token_ids))

    def forward_last(self, token_ids) -> np.ndarray:
        """The last row of :meth:`forward_full`, without the LM head of the
        other rows (with a real vocabulary the head is the largest matmul).

        Parameters
        ----------
        token_ids : array_like of int, shape (n,), n >= 1

        Returns
        -------
        numpy.ndarray
            float32 logits, shape ``(vocab_size,)``: the prediction of token ``n``.
        """
        ids = self._check_tokens(token_ids)
        if not ids.size:
            raise ValueError("token_ids: expected at least one token, got none")
        return self.logits(self._final_stream(ids)[-1:])[0]

    def _final_stream(self, token_ids) -> np.ndarray:
        """Residual stream after the last block, no cache."""
        x = self.embed(token_ids)
        n = x.shape[0]
        pos = np.arange(n, dtype=np.int64)
        for layer in range(self.config.num_layers):
            q, k, v = self.layer_qkv(layer, x, pos)
            attn = self.attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), pos, n)
            x = self.layer_finish(layer, x, attn)
        return x

    def forward_with_cache(self, token_ids, cache: "NumpyContiguousCache") -> np.ndarray:
        """Run new tokens through a :class:`NumpyContiguousCache`.

        The tokens take positions ``cache.seq_len ..``; their K/V are stored in
        ``cache`` and attention reads the whole history back from it. Works for
        a prompt (many tokens) and for a decode step (one token) alike.

        Parameters
        ----------
        token_ids : array_like of int, shape (n,)
        cache : NumpyContiguousCache

        Returns
        -------
        numpy.ndarray
            float32 logits, shape ``(n, vocab_size)``.
        """
        x = self.embed(token_ids)
        start = cache.seq_len
        pos = start + np.arange(x.shape[0], dtype=np.int64)
        for layer in range(self.config.num_layers):
            q, k, v = self.layer_qkv(layer, x, pos)
            cache.update(layer, k, v)
            k_all, v_all = cache.get(layer)
            x = self.layer_finish(layer, x, self.attention(q, k_all, v_all, pos, k_all.shape[1]))
        return self.logits(x)


class TinyTransformer(LlamaDecoder):
    """A small random-weight Llama-style decoder.

    Parameters
    ----------
    config : ModelConfig, optional
        Model shape; the default is 4 layers, 8 query heads, 2 KV heads,
        head_dim 64, vocabulary 512.
    seed : int, optional
        Seed for :func:`numpy.random.default_rng`; the same seed always gives
        the same weights.

    Notes
    -----
    Every weight matrix is drawn from N(0, 1/fan_in), so a projection of a
    unit-RMS vector stays unit-RMS. The two residual branches of each block
    are further scaled by ``1/sqrt(2 * num_layers)`` so the residual stream
    does not grow with depth. The LM head is separate from the embedding:
    with a tied head a random model mostly predicts its own input token, and
    greedy decoding would stall on one id.
    """

    def __init__(self, config: ModelConfig | None = None, seed: int = 0) -> None:
        cfg = config if config is not None else ModelConfig()
        rng = np.random.default_rng(seed)
        f32 = np.float32

        def dense(fan_in: int, fan_out: int, gain: float = 1.0) -> np.ndarray:
            w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
            return w * f32(gain / np.sqrt(fan_in))

        hidden = cfg.hidden
        branch_gain = 1.0 / np.sqrt(2.0 * cfg.num_layers)
        # Unit-variance embeddings: the residual stream starts at RMS ~1.
        embedding = rng.standard_normal((cfg.vocab_size, hidden), dtype=np.float32)
        layers = []
        for _ in range(cfg.num_layers):
            layers.append({
                "attn_norm": np.ones(hidden, dtype=f32),
                "wq": dense(hidden, hidden),
                "wk": dense(hidden, cfg.kv_dim),
                "wv": dense(hidden, cfg.kv_dim),
                "wo": dense(hidden, hidden, branch_gain),
                "mlp_norm": np.ones(hidden, dtype=f32),
                "w_gate": dense(hidden, cfg.ffn_hidden),
                "w_up": dense(hidden, cfg.ffn_hidden),
                "w_down": dense(cfg.ffn_hidden, hidden, branch_gain),
            })
        final_norm = np.ones(hidden, dtype=f32)
        # Gain 4 spreads the logits (std ~4) so the softmax is not flat and the
        # greedy choice is not decided by rounding noise.
        lm_head = dense(hidden, cfg.vocab_size, gain=4.0)
        super().__init__(cfg, embedding, layers, final_norm, lm_head)


class NumpyContiguousCache:
    """The naive contiguous KV cache: one preallocated array per layer.

    Per layer, K and V are float32 arrays of shape
    ``(1, num_kv_heads, max_seq_len, head_dim)``, allocated in full up front
    and filled by slice assignment, the way a plain NumPy/PyTorch decoding
    loop keeps its cache. It is the baseline the demo compares the paged
    cache with: simple and fast, but it reserves ``max_seq_len`` positions per
    sequence whether they are used or not, and cannot share prefixes.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model shape (see :meth:`from_config`).
    max_seq_len : int
        Positions reserved per layer.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("max_seq_len", max_seq_len)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.max_seq_len = int(max_seq_len)
        shape = (1, self.num_kv_heads, self.max_seq_len, self.head_dim)
        self.k = [np.zeros(shape, dtype=np.float32) for _ in range(self.num_layers)]
        self.v = [np.zeros(shape, dtype=np.float32) for _ in range(self.num_layers)]
        # Lengths are per layer because a forward pass fills the layers one
        # after another; seq_len is the part every layer has.
        self._lens = [0] * self.num_layers

    @classmethod
    def from_config(cls, config: ModelConfig, max_seq_len: int) -> "NumpyContiguousCache":
        """Make a cache shaped for ``config`` holding ``max_seq_len`` positions."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, max_seq_len)

    @property
    def seq_len(self) -> int:
        """Positions written in every layer."""
        return min(self._lens)

    def layer_len(self, layer: int) -> int:
        """Positions written in ``layer``."""
        return self._lens[layer]

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append ``n`` positions to ``layer``.

        Parameters
        ----------
        layer : int
        k, v : numpy.ndarray, shape (n, num_kv_heads, head_dim)
            Token-major, as :meth:`TinyTransformer.layer_qkv` returns them.

        Raises
        ------
        ValueError
            If the shapes are wrong or the write would pass ``max_seq_len``
            (nothing is written then).
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer: expected 0..{self.num_layers - 1}, got {layer!r}")
        k = np.asarray(k)
        v = np.asarray(v)
        if k.ndim != 3 or k.shape[1:] != (self.num_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"k, v: expected equal shapes (n, {self.num_kv_heads}, {self.head_dim}), "
                f"got {k.shape} and {v.shape}")
        start = self._lens[layer]
        end = start + k.shape[0]
        if end > self.max_seq_len:
            raise ValueError(
                f"k: writing {k.shape[0]} positions at {start} passes max_seq_len={self.max_seq_len}")
        self.k[layer][0, :, start:end] = k.transpose(1, 0, 2)
        self.v[layer][0, :, start:end] = v.transpose(1, 0, 2)
        self._lens[layer] = end

    def get(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of everything written in ``layer``.

        Returns
        -------
        k, v : numpy.ndarray
            float32 views, shape ``(num_kv_heads, layer_len, head_dim)``; they
            alias the cache, so later writes show through.
        """
        n = self._lens[layer]
        return self.k[layer][0, :, :n], self.v[layer][0, :, :n]

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self._lens = [0] * self.num_layers

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the preallocated arrays, used or not."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @property
    def used_bytes(self) -> int:
        """Bytes holding written positions (``seq_len`` in every layer)."""
        return self.seq_len * self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4
