"""Integer arguments and how an error message shows what was given
(internal; imports nothing of kvcore, so that every module, the stores
included, can use it)."""
import operator

import numpy as np

# Integers kvcore takes (counts, sizes, positions, ids, seeds) fit in 64
# bits; one of more than MAX_INT_BITS bits is refused here, before a range
# error can print it (Python will not turn an int of more than 4300 digits
# into text: the message would raise its own, nameless ValueError).  Wider
# than 64 so that the range errors still name values such as 2**64.
MAX_INT_BITS = 256


def index_int(value, arg):
    """``value`` as an int (bools and floats rejected; at most
    MAX_INT_BITS bits, sign apart)."""
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{arg} must be an integer, got bool {value!r}")
        if _is_bool_tensor(value):
            raise TypeError(f"{arg} must be an integer, got a bool {type(value).__name__} "
                            f"{shown(value)}")
        ndim = _ndim(value)
        if ndim:
            # (torch's __index__ reads any 1-element tensor, [3] and [[3]]
            # alike, as its element; NumPy refuses all but 0-d arrays)
            raise TypeError(f"{arg} must be an integer (a 0-d array or tensor at most), got "
                            f"a {type(value).__name__} with ndim {ndim}: {shown(value)}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{arg} must be an integer, got {type(value).__name__} "
                            f"{shown(value)}") from None
    if value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"{arg} must be an integer of at most {MAX_INT_BITS} bits, got "
                         f"{shown(value)}")
    return value


def _is_bool_tensor(value):
    """Whether ``value`` is a torch tensor of bools (whose __index__ gives
    0 or 1, where Python's and NumPy's bools are refused above)."""
    try:
        return str(getattr(value, "dtype", "")) == "torch.bool"
    except Exception:           # (a dtype that raises or prints badly: not a tensor)
        return False


def _ndim(value):
    """``value.ndim`` where it is an int (an array or a tensor), else 0."""
    try:
        ndim = getattr(value, "ndim", 0)
    except Exception:           # (a property that raises: not an array)
        return 0
    return ndim if type(ndim) is int else 0


def shown(value, limit=200):
    """What an error message shows of a given ``value``: its repr, cut to
    ``limit`` characters; an int of more than MAX_INT_BITS bits as its size
    (its digits may be too many to print); a repr that fails: its type."""
    # (int's own methods: an int subclass's bit_length or < may raise)
    if isinstance(value, int) and not isinstance(value, bool) \
            and int.bit_length(value) > MAX_INT_BITS:
        return (f"{'a negative' if int.__lt__(value, 0) else 'an'} integer of "
                f"{int.bit_length(value)} bits")
    try:
        text = repr(value)
        return text if len(text) <= limit else text[:limit] + "..."
    except Exception:           # (e.g. an int too long to print, inside a container)
        return f"<{type(value).__name__}>"
