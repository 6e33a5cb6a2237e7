"""The command line and the config: key=value parsed to each key's type, presets layered, values checked."""
from __future__ import annotations

import ast
import difflib
import math

from unet_amp.common import IGNORE_INDEX, UserError

# Keys that take a value of another type beside their default's: (key -> the extra values allowed)
EXTRA_VALUES = {"batch_size": ("auto",), "class_weights": ("auto",), "channels_last": ("auto",)}
# The type of the keys whose default (None, "auto") is not of the type their other values take
TYPED_AS = {"channels_last": True, "num_workers": 0, "max_train_images": 0, "early_stopping_patience": 0,
            "ema_decay": 0.0, "grad_clip_norm": 0.0, "intensity_range": [0.0], "class_weights": [0.0]}
CHOICES = {
    "data_mode": ("fit", "patch"),
    "amp_dtype": ("auto", "bfloat16", "float16"),
    "tta": ("none", "flip", "d4"),
    "logger": ("auto", "tensorboard", "csv", "none"),
    "tf32_matmul_precision": (None, "highest", "high", "medium"),
}


def parse_value(text):
    """'8' -> 8, '2e-3' -> 0.002, 'None' -> None, 'true' -> True, '1,5' -> [1, 5], anything else: the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return list(value) if isinstance(value, (tuple, list)) else value


def cast(key, value, default):
    """`value` in the type of CONFIG's `default` for `key` (TYPED_AS where that default is None or a word), or a
    UserError naming the key."""
    default = TYPED_AS.get(key, default)
    value = list(value) if isinstance(value, tuple) else value
    if key in CHOICES:  # checked against the choices later; the word none was read as None
        return "none" if value is None and "none" in CHOICES[key] else value
    if value is None or value in EXTRA_VALUES.get(key, ()):
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool):
        ok = isinstance(value, bool) or (number and value in (0, 1))
    elif isinstance(default, int):
        ok = number and float(value).is_integer()
    elif isinstance(default, float):
        ok = number
    elif isinstance(default, list):
        ok = isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    else:
        ok = True
    if not ok:
        extra = "".join(f" or {v}" for v in (*EXTRA_VALUES.get(key, ()), *([None] if key in TYPED_AS else [])))
        raise UserError(f"{key}={value!r}: expected {type(default).__name__} like {default!r}{extra}")
    kind = {bool: bool, int: int, float: float, str: str}.get(type(default))
    return kind(value) if kind else value


def unknown_key(key, defaults):
    close = difflib.get_close_matches(key, defaults, n=1)
    hint = f"did you mean {close[0]}?" if close else "--help lists the keys"
    return UserError(f"{key}: unknown key; {hint}")


def parse_args(argv, defaults):
    """(defaults updated with the overrides, the keys typed): `argv` a list of key=value texts, or a dict of
    values (a notebook's); every value cast to its default's type."""
    pairs = argv.items() if isinstance(argv, dict) else [split_pair(arg) for arg in argv]
    cfg, typed = dict(defaults), set()
    for key, value in pairs:
        if key not in defaults:
            raise unknown_key(key, defaults)
        cfg[key] = cast(key, value, defaults[key])
        typed.add(key)
    return cfg, typed


def split_pair(arg):
    key, eq, text = arg.partition("=")
    if not eq:
        raise UserError(f"{arg}: not key=value; write settings as key=value, e.g. batch_size=2")
    return key, parse_value(text)


def with_preset(cfg, typed, presets):
    """CONFIG < preset < command line: the preset's values, except for the keys typed."""
    name = cfg.get("preset")
    if name is None:
        return cfg
    if name not in presets:
        raise UserError(f"preset={name!r}: unknown preset; use one of {', '.join(presets)} or None")
    return {**cfg, **{k: v for k, v in presets[name].items() if k not in typed}}


def rules(cfg):
    """(key, a test of its value, what is allowed) for every train key with a range: the one table of limits."""
    n, w = cfg["num_classes"], cfg["class_weights"]
    slots = max(2, n) if isinstance(n, int) else 2  # class weights: [background, foreground] when binary
    return [
        ("image_size", lambda: cfg["image_size"] >= 32 and cfg["image_size"] % 32 == 0,
         "a multiple of 32 (the U-Net halves it 5 times)"),
        ("in_channels", lambda: cfg["in_channels"] >= 1, "a whole number >= 1"),
        ("num_classes", lambda: 1 <= n < IGNORE_INDEX, f"1 (binary) or a class count below {IGNORE_INDEX}"),
        ("val_fraction", lambda: 0 < cfg["val_fraction"] < 1, "between 0 and 1, e.g. 0.2"),
        ("max_train_images", lambda: cfg["max_train_images"] is None or cfg["max_train_images"] >= 1,
         ">= 1, or None"),
        ("num_workers", lambda: cfg["num_workers"] is None or cfg["num_workers"] >= 0, ">= 0, or None (auto)"),
        ("intensity_range", lambda: cfg["intensity_range"] is None or (isinstance(cfg["intensity_range"], list)
         and len(cfg["intensity_range"]) == 2 and cfg["intensity_range"][0] < cfg["intensity_range"][1]),
         "low,high with low < high, or None (learnt)"),
        ("patch_scale", lambda: 0 < cfg["patch_scale"] <= 4, "in (0, 4]; 1.0 = native resolution"),
        ("tile_overlap", lambda: 0 <= cfg["tile_overlap"] <= 0.9, "in [0, 0.9]"),
        ("class_weights", lambda: w is None or w == "auto" or (isinstance(w, list) and len(w) == slots
         and all(isinstance(x, (int, float)) and x >= 0 for x in w) and any(w)),
         f"None, auto, or {slots} weights >= 0, one per class"),
        ("epochs", lambda: cfg["epochs"] >= 1, "a whole number >= 1"),
        ("batch_size", lambda: cfg["batch_size"] == "auto" or cfg["batch_size"] >= 1, "a whole number >= 1, or auto"),
        ("accumulation_steps", lambda: cfg["accumulation_steps"] >= 1, "a whole number >= 1"),
        ("learning_rate", lambda: 0 < cfg["learning_rate"] < math.inf, "a number > 0"),
        ("weight_decay", lambda: cfg["weight_decay"] >= 0, ">= 0"),
        ("warmup_fraction", lambda: 0 <= cfg["warmup_fraction"] < 1, "in [0, 1)"),
        ("grad_clip_norm", lambda: cfg["grad_clip_norm"] is None or cfg["grad_clip_norm"] > 0, "> 0, or None"),
        ("ema_decay", lambda: cfg["ema_decay"] is None or 0 < cfg["ema_decay"] < 1, "in (0, 1), e.g. 0.99, or None"),
        ("early_stopping_patience",
         lambda: cfg["early_stopping_patience"] is None or cfg["early_stopping_patience"] >= 1,
         ">= 1, or None"),
        ("seed", lambda: 0 <= cfg["seed"] < 2**32, "in [0, 2**32)"),
        ("device", lambda: cfg["device"] in ("auto", "cpu", "cuda", "mps") or cfg["device"].startswith("cuda:"),
         "auto, cpu, cuda, cuda:N or mps"),
        ("nan_patience", lambda: cfg["nan_patience"] >= 1, "a whole number >= 1"),
    ]


def check_choices(cfg, choices=CHOICES):
    """Each key of `choices` (a command's) holds one of its allowed values, or a UserError naming the key."""
    for key, allowed in choices.items():
        if key in cfg and cfg[key] not in allowed:
            raise UserError(f"{key}={cfg[key]!r}: not one of {', '.join(map(str, allowed))}")


def check_config(cfg):
    """Every value in its range, or a UserError naming the key, its value and what is allowed."""
    check_choices(cfg)
    for key, test, allowed in rules(cfg):
        try:
            ok = test()
        except (TypeError, AttributeError):  # a value of another type, edited into CONFIG
            ok = False
        if not ok:
            raise UserError(f"{key}={cfg[key]!r}: must be {allowed}")
    return cfg


def train_config(defaults, presets, argv):
    """(the config a run starts from, the keys typed): CONFIG < preset < command line, checked."""
    cfg, typed = parse_args(argv, defaults)
    return check_config(with_preset(cfg, typed, presets)), typed


def format_config(cfg):
    """One 'key = value' line per key, for the banner and --help."""
    width = max(map(len, cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in cfg.items())
