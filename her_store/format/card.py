"""The dataset card: Minari's dataset fields plus HER's own (reward function, goal keys, success threshold), checked.

A card is the store's ``metadata`` attribute (FORMAT.md). Nothing in it is trusted or run: the reward function is
a ``"module:function"`` string, imported only by :func:`resolve_reward_function`, which a user calls explicitly.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from her_store.checks import is_number
from her_store.errors import short_repr

__all__ = ["CARD_FIELDS", "card_problems", "check_card", "json_object", "parse_assignment", "resolve_reward_function"]

# name -> (kind, what it holds). Minari's dataset fields first, then HER's own.
CARD_FIELDS: dict[str, tuple[str, str]] = {
    "dataset_id": ("str", "Minari-style id, e.g. 'fetch/reach/random-v0'"),
    "env_id": ("str", "gymnasium id of the environment"),
    "env_spec": ("str", "the environment's EnvSpec as JSON (gymnasium's EnvSpec.to_json())"),
    "algorithm_name": ("str", "the policy or algorithm that collected the episodes"),
    "author": ("str|list", "author name(s)"),
    "author_email": ("str|list", "author email(s)"),
    "code_permalink": ("str", "link to the code that collected the episodes"),
    "description": ("str", "what the dataset holds"),
    "license": ("str", "e.g. 'CC-BY-4.0'"),
    "versions": ("dict", "versions of the packages used, e.g. {'her_store': '0.1.0', 'gymnasium': '1.2.0'}"),
    "requirements": ("list", "pip requirements to use the dataset's environment"),
    "ref_min_score": ("number", "reference score of a random policy"),
    "ref_max_score": ("number", "reference score of an expert policy"),
    "reward_function": (
        "str", "'module:function' computing reward(achieved_goal, desired_goal, info); never run on open"
    ),
    "goal_keys": ("list", "[achieved key, desired key], default ['achieved_goal', 'desired_goal']"),
    "success_threshold": ("number", "distance under which a goal counts as reached"),
}
_KINDS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "str|list": lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "dict": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
    "number": lambda v: is_number(v, finite=True),
}
_REWARD_FN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
MAX_CARD_BYTES = 1 << 20  # a card is a few KB; a larger one is not a card


def check_card(card: Mapping[str, Any], where: str = "the dataset card") -> dict[str, Any]:
    """A card checked: JSON values, the known fields of the right kind, at most 1 MiB. Returns a plain dict copy.

    Unknown keys are kept (any JSON value). Nothing is imported or run.

    Raises
    ------
    ValueError
        Naming the field, what it holds and what was expected.

    Examples
    --------
    >>> check_card({"env_id": "FetchReach-v4", "success_threshold": 0.05})
    {'env_id': 'FetchReach-v4', 'success_threshold': 0.05}
    >>> check_card({"ref_min_score": "low"})
    Traceback (most recent call last):
    ValueError: the dataset card's 'ref_min_score' is 'low'; expected number (reference score of a random policy)
    """
    if not isinstance(card, Mapping):
        raise ValueError(f"{where} is a {type(card).__name__}, expected a JSON object")
    try:
        text = json.dumps(dict(card), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} holds a value that is not JSON: {e}") from None
    if len(text) > MAX_CARD_BYTES:
        raise ValueError(f"{where} is {len(text):,} bytes of JSON; at most {MAX_CARD_BYTES:,} are kept")
    out = json.loads(text)
    for key, value in out.items():
        if key in CARD_FIELDS and value is not None:
            kind, what = CARD_FIELDS[key]
            if not _KINDS[kind](value):
                raise ValueError(f"the dataset card's {key!r} is {short_repr(value)}; expected {kind} ({what})")
    fn = out.get("reward_function")
    if fn is not None and not _REWARD_FN.match(fn):
        raise ValueError(f"the dataset card's 'reward_function' is {short_repr(fn)}; expected 'module:function'")
    goals = out.get("goal_keys")
    if goals is not None and len(goals) != 2:
        raise ValueError(f"the dataset card's 'goal_keys' is {short_repr(goals)}; expected [achieved key, desired key]")
    return out


def card_problems(card: Mapping[str, Any]) -> list[str]:
    """What :func:`check_card` would refuse in a card read from a store, one message per field, without raising.

    A store opens whatever its card holds (opening shows what is there); ``her-store inspect`` shows these as
    warnings, and an edit must fix them before the card is written.

    Examples
    --------
    >>> card_problems({"env_id": "FetchReach-v4", "ref_min_score": "low", "goal_keys": ["a"]})  # doctest: +ELLIPSIS
    ["the dataset card's 'ref_min_score' is 'low'; expected number ...", "the dataset card's 'goal_keys' is ['a']; ..."]
    """
    if not isinstance(card, Mapping):
        return [f"the dataset card is a {type(card).__name__}, expected a JSON object"]
    problems = []
    for key, value in card.items():
        try:
            check_card({key: value}, f"the dataset card's {key!r}")
        except ValueError as e:
            problems.append(str(e))
    if not problems:
        try:
            check_card(card)
        except ValueError as e:  # too large as a whole
            problems.append(str(e))
    return problems


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` as typed on a command line: the value is read as JSON when it is JSON, else kept as a string;
    a field the card holds as a string (``env_id``, ``license``, ...) keeps the text as typed.

    ``key=`` (nothing after ``=``) removes the key (the value is None).

    Examples
    --------
    >>> parse_assignment("ref_max_score=1.5"), parse_assignment("author=Ada"), parse_assignment("license=")
    (('ref_max_score', 1.5), ('author', 'Ada'), ('license', None))
    >>> parse_assignment("env_id=123"), parse_assignment('goal_keys=["a", "b"]')
    (('env_id', '123'), ('goal_keys', ['a', 'b']))
    """
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ValueError(f"{text!r} is not key=value (e.g. author=Ada, ref_max_score=1.0, goal_keys='[\"a\",\"b\"]')")
    if raw == "":
        return key, None
    if CARD_FIELDS.get(key, ("",))[0] == "str":
        return key, raw
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def resolve_reward_function(card: Mapping[str, Any]) -> Callable[..., Any]:
    """Import the card's ``reward_function`` (``"module:function"``). This runs the module's code: call it only
    for a dataset whose code you trust. Opening a store never calls it.

    Raises
    ------
    ValueError
        The card names no reward function, or not as ``module:function``.
    ImportError, AttributeError
        The module or function does not exist here.

    Examples
    --------
    >>> resolve_reward_function({"reward_function": "her_store.envs:point_reward"})  # doctest: +SKIP
    """
    spec = check_card({"reward_function": card.get("reward_function")})["reward_function"]
    if spec is None:
        raise ValueError("the dataset card names no reward_function ('module:function')")
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"the card's reward_function {spec!r} is not callable")
    return obj


def json_object(text: str) -> dict[str, Any]:
    """A command-line option holding a JSON object (``--storage-options``, ``--algo-kwargs``), for argparse's ``type``.

    Examples
    --------
    >>> json_object('{"anon": true}')
    {'anon': True}
    """
    import argparse

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"key\": 1}}', got {text!r}")
    return value
