"""Settings declared once, as typed objects; their command-line flags generated from them, never written
by hand.

A settings class (a ``CommandSettings``: a frozen pydantic model) declares each setting once: its type and
bounds, its default, its help text (the field's description) and, where the plain ``--field-name VALUE``
form is not enough, a ``Flag`` in its annotation (other spellings, an argparse value type, a switch, a
repeatable flag). ``add_arguments`` generates one flag per field; ``from_args`` reads the parsed flags
back into the object, checked. As llama-cpp-python's server settings: the object is the source, the
argparse flags are derived from it. ``runtime.settings.LoadSettings`` (every command's load flags),
``server.settings.ServerSettings`` (``serve`` and ``ui``) and ``tools.tune_command.TuneSettings`` are such
classes.

The environment: a class with an ``env_prefix`` also reads each of its settings from a variable, the
prefix and the flag's name (``--api-key`` -> ``CLEF_GGUF_API_KEY``), checked by the very flag, so a bad
value is refused as it would be on the command line, naming the variable. A flag given wins over its
variable, a variable over the default. A repeatable flag's variable holds a comma-separated list, a
switch's ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``; an empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import pydantic

from clef_gguf.core import errors

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
GIVEN = "_flags_given"  # the parsed namespace's record of the fields whose flags were on the command line


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line, when its plain ``--name VALUE`` form is not enough."""

    names: tuple[str, ...] = ()  # option strings; () -> ("--field-name",)
    type: Callable[[str], Any] | None = None  # argparse's value type (refuses with exit 2)
    action: str | None = None  # "store_true", "append"
    metavar: str | None = None
    to_setting: Callable[[Any], Any] | None = None  # the parsed value -> the field's value
    help: str | None = None  # where the flag says it the other way round (--offline)
    # argparse's default is None, so the field counts as given only when the flag is: the runtime may
    # then fill it from what `clef-gguf tune` measured (the field's own default otherwise)
    unless_given: bool = False
    nargs: str | None = None  # "?": the value may be left out (then ``const``)
    const: Any = None


class CommandSettings(pydantic.BaseModel):
    """A settings object whose flags are generated from its fields (see the module's docstring)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    flag_group: ClassVar[str | None] = None  # the flags' group in --help; None: the parser's own options
    flag_group_help: ClassVar[str | None] = None
    env_prefix: ClassVar[str | None] = None  # "CLEF_GGUF_": each flag also read from $CLEF_GGUF_<FLAG>

    # ------------------------------------------------------------ the declaration, read
    @classmethod
    def flag(cls, name: str) -> Flag:
        return next((m for m in cls.model_fields[name].metadata if isinstance(m, Flag)), Flag())

    @classmethod
    def option_strings(cls, name: str) -> tuple[str, ...]:
        return cls.flag(name).names or (f"--{name.replace('_', '-')}",)

    @classmethod
    def option(cls, name: str) -> str:
        """The field's flag, by its first long spelling (``--model``, not ``-m``)."""
        return next(o for o in cls.option_strings(name) if o.startswith("--"))

    @classmethod
    def env_var(cls, name: str) -> str | None:
        """The environment variable that sets the field (None where the class reads none)."""
        if cls.env_prefix is None:
            return None
        return cls.env_prefix + cls.option(name).removeprefix("--").replace("-", "_").upper()

    # ------------------------------------------------------------ the command line, derived
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, omit: Collection[str] = (),
                      defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None) -> None:
        """One flag per field: its help, type and default from the field. A command's variations are
        overrides of the same declaration: ``omit`` (fields it has no flag for: they keep their
        default), ``defaults`` and ``helps`` (by field name)."""
        unknown = (set(omit) | set(defaults or {}) | set(helps or {})) - set(cls.model_fields)
        assert not unknown, f"{cls.__name__} has no setting {sorted(unknown)}"
        group: Any = parser
        if cls.flag_group is not None:
            group = parser.add_argument_group(cls.flag_group, cls.flag_group_help)
        for name in cls.model_fields:
            if name in omit:
                continue
            kwargs = cls._argument(name, record=cls.env_prefix is not None)
            if defaults and name in defaults:
                kwargs["default"] = defaults[name]
            if helps and name in helps:
                kwargs["help"] = helps[name]
            if (var := cls.env_var(name)) is not None:
                kwargs["help"] = f"{kwargs['help']} [env: {var}]"
            group.add_argument(*cls.option_strings(name), **kwargs)

    @classmethod
    def _argument(cls, name: str, *, record: bool = False) -> dict[str, Any]:
        """``add_argument``'s keywords for the field. ``record``: its action notes in the namespace
        that the flag was given (``GIVEN``), so that its environment variable yields to it."""
        spec, flag = cls.model_fields[name], cls.flag(name)
        kwargs: dict[str, Any] = {"dest": name, "help": flag.help or spec.description}
        if flag.action:
            kwargs["action"] = _RECORDING[flag.action] if record else flag.action
        elif record:
            kwargs["action"] = _GivenStore
        if flag.action != "store_true":
            kwargs["type"] = flag.type
            choices = _choices(spec.annotation)
            if choices and not flag.type:
                kwargs["choices"] = choices
        for key in ("metavar", "nargs", "const"):
            if getattr(flag, key) is not None:
                kwargs[key] = getattr(flag, key)
        if spec.is_required():
            kwargs["required"] = True
        else:
            kwargs["default"] = False if flag.action == "store_true" else None \
                if flag.action or flag.unless_given else spec.default
        return kwargs

    @classmethod
    def values_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The field values the parsed flags (``add_arguments``) give, and the environment where the
        class reads it: a flag given, else its variable, else the parser's default. A field the
        command has no flag for (``omit``) is left out: it keeps its default."""
        given: Collection[str] = getattr(args, GIVEN, frozenset())
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            if not hasattr(args, name):
                continue
            flag, value = cls.flag(name), getattr(args, name)
            var = cls.env_var(name)
            if var is not None and name not in given and os.environ.get(var, "").strip():
                value = cls._from_environment(name, var, os.environ[var])
            if flag.unless_given and value is None:
                continue  # not given: the field's default, and not in model_fields_set
            if flag.action == "append" and flag.to_setting is None and value is None:
                continue  # a repeatable flag never given: the field's default
            values[name] = flag.to_setting(value) if flag.to_setting is not None else value
        return values

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> Self:
        """The settings a command's parsed flags give (``add_arguments``), ``overrides`` on top."""
        return cls.checked(cls.values_from_args(args) | overrides)

    @classmethod
    def from_environment(cls, **values: Any) -> Self:
        """The settings the environment gives where no command line is parsed (Ray's ``serve run``),
        ``values`` on top: every variable checked as its flag is."""
        found = {}
        for name in cls.model_fields:
            var = cls.env_var(name)
            if var is not None and name not in values and os.environ.get(var, "").strip():
                raw = cls._from_environment(name, var, os.environ[var])
                flag = cls.flag(name)
                found[name] = flag.to_setting(raw) if flag.to_setting is not None else raw
        return cls.checked(found | values)

    @classmethod
    def checked(cls, values: Mapping[str, Any]) -> Self:
        """The settings from field values, a bad one refused as ``invalid_setting`` naming its flag."""
        try:
            return cls(**values)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "settings"
            if first["type"] == "extra_forbidden" or name not in cls.model_fields:
                raise errors.InvalidSetting(f"unknown setting {name!r}", field=name) from None
            raise errors.InvalidSetting(f"{cls.option(name)}: {first['msg'].lower()} (got {values.get(name)!r})",
                                        field=name) from None

    @classmethod
    def _from_environment(cls, name: str, var: str, text: str) -> Any:
        """The value ``$var`` gives the field's flag, parsed by that very flag (its type, choices)."""
        flag, option = cls.flag(name), cls.option(name)
        if flag.action == "store_true":
            word = text.strip().lower()
            if word in TRUE_WORDS + FALSE_WORDS:
                return word in TRUE_WORDS
            raise errors.InvalidSetting(
                f"environment variable {var}={text!r}: expected {'/'.join(TRUE_WORDS)} (as {option}) "
                f"or {'/'.join(FALSE_WORDS)}", field=var)
        items: Sequence[str] = [t.strip() for t in text.split(",") if t.strip()] \
            if flag.action == "append" else [text]
        parser = argparse.ArgumentParser(prog=var, add_help=False, exit_on_error=False)
        parser.add_argument(option, **cls._argument(name) | {"required": False})
        try:
            parsed = parser.parse_args([f"{option}={item}" for item in items])
        except argparse.ArgumentError as exc:
            raise errors.InvalidSetting(f"environment variable {var}={text!r}: {exc.message} "
                                        f"(it sets {option})", field=var) from None
        return getattr(parsed, name)


# ---------------------------------------------------------------- actions that record the flags given
def _given(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {dest})


class _GivenStore(argparse._StoreAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _given(namespace, self.dest)


class _GivenAppend(argparse._AppendAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _given(namespace, self.dest)


class _GivenSwitch(argparse._StoreTrueAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _given(namespace, self.dest)


_RECORDING: dict[str, type[argparse.Action]] = {"append": _GivenAppend, "store_true": _GivenSwitch}


def _choices(annotation: Any) -> list[str] | None:
    args = getattr(annotation, "__args__", ())
    if getattr(annotation, "__origin__", None) is Literal:
        return [str(a) for a in args]
    return None
