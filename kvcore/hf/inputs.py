"""What a model is given: a left-padded prompt batch and its mask, the
keyword it takes its cache by, a ``use_cache`` flag."""
import inspect

import numpy as np
import torch

from .._validate import MAX_TOKEN_ID, index_int


def _query_length(query, arg="query_length"):
    """The query length transformers passes to get_mask_sizes: an int >= 0
    (a Python or NumPy integer, never a bool, a float or a string), or
    (transformers 5.0-5.x) the query's 1-D cache_position tensor; anything
    else raises naming ``arg``."""
    if isinstance(query, torch.Tensor):
        if query.ndim != 1:
            raise ValueError(f"{arg} must be an integer or the query's 1-D cache_position "
                             f"tensor, got a tensor of shape {tuple(query.shape)}")
        return int(query.shape[0])
    n = index_int(query, arg)
    if n < 0:
        raise ValueError(f"{arg} must be a non-negative integer, got {n}")
    return n


def _prompt_batch(input_ids, attention_mask, model=None):
    """``(attention_mask, pads)`` of a left-padded prompt batch after
    checking both (the mask defaults to all ones); with ``model``, every id
    (the padding's too: the model embeds it) a row of its input embedding,
    which would otherwise fail inside torch (on a GPU, as a device-side
    assertion that ends the process's CUDA context)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        got = (f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError("input_ids must be a 2-D torch tensor (batch, length) with at least "
                         f"one column, got {got}")
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must have at least one row (batch, length), got shape "
                         f"{tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
            or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch tensor (batch, length) or None, got "
                        f"{type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    pads = _left_pads(attention_mask, "attention_mask")
    # the ids of the tokens (never the padding's) are what the cache records
    ids = input_ids.detach().cpu().numpy()
    bad = (np.arange(ids.shape[1])[None, :] >= pads[:, None]) & ((ids < 0) | (ids > MAX_TOKEN_ID))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"input_ids must lie in 0..{MAX_TOKEN_ID} (token ids) where "
                         f"attention_mask is 1, got {int(ids[row, col])} at row {row}, "
                         f"column {col}")
    rows = _embedding_rows(model)
    if rows is not None:
        bad = (ids < 0) | (ids >= rows)
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"input_ids must lie in 0..{rows - 1} (the rows of the model's "
                             f"input embedding; padding included, the model embeds it), got "
                             f"{int(ids[row, col])} at row {row}, column {col}")
    return attention_mask, pads


def _embedding_rows(model):
    """The rows of ``model``'s input embedding (an ``nn.Embedding``), or
    None when there is no model or it has another kind of input layer."""
    if model is None:
        return None
    try:
        emb = model.get_input_embeddings()
    except Exception:           # (no such layer, or a model that cannot say: no check)
        return None
    return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else None


def _left_pads(mask, arg, empty_rows=False):
    """Padding columns before each row's first token of a 2-D 0/1 mask;
    raises ValueError unless the mask is left padding (with ``empty_rows``,
    a row of padding only is: its padding is every column)."""
    m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"{arg} must be 2-D (batch, columns), got shape {m.shape}")
    if m.dtype != bool and m.size:
        # (another value would be read as a token here, but transformers
        # counts the mask's values into the positions; integers by their
        # bounds first: every forward's whole mask comes here)
        if m.dtype.kind not in "iu" or m.min() < 0 or m.max() > 1:
            odd = (m != 0) & (m != 1)
            if odd.any():
                row, col = (int(i) for i in np.argwhere(odd)[0])
                raise ValueError(f"{arg} must hold 0 (padding) and 1 (tokens), got "
                                 f"{m[row, col].item()!r} at row {row}, column {col}")
    m = m if m.dtype == bool else m != 0
    pads = np.argmax(m, axis=1).astype(np.int64)
    tokens = np.count_nonzero(m, axis=1)
    empty = tokens == 0
    if empty.any():
        if not empty_rows:
            raise ValueError(f"{arg} row {int(np.argmax(empty))} has no tokens")
        pads[empty] = m.shape[1]
    # (left padding: every column from a row's first token on is a token)
    wrong = tokens != m.shape[1] - pads
    if wrong.any():
        bad = int(np.argmax(wrong))
        raise ValueError(f"{arg} must be left padding (zeros, then ones), row {bad} is "
                         f"{m[bad].astype(int).tolist()}")
    return pads


#: the keywords a model's forward (and its output) may hold its cache by
CACHE_KEYWORDS = ("past_key_values", "cache")


def cache_keyword(model):
    """The keyword ``model`` takes its cache by: ``"cache"`` (recent
    transformers 5) or ``"past_key_values"`` (earlier)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _truthy(value):
    """``bool(value)``, False for anything that has no truth value (a tensor
    of several elements): such a use_cache turns no cache on."""
    try:
        return bool(value)
    except Exception:
        return False
