"""The SystemOne request on the wire, as one pydantic model: the parser (``pipeline.request``) validates
a body with it, and ``/openapi.json`` shows it.

Validation is the reference's, lenient: any JSON state, a question's type checked and its criteria
left to the parser (which names each error by field, in its own order), other keys kept aside to be
named in ``warnings``. The document shows the contract per question type (``DocumentedAs``); it never
refuses a body the parser accepts. What JSON Schema cannot say (lone surrogates, prompts too long for
the window, instructions that render to no tokens) is refused by the parser only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema as cs

from clef_gguf.core.questions import MAX_QUESTIONS, QUESTION_TYPES, TYPES, Criteria, QuestionType

if TYPE_CHECKING:
    TypeName = str
else:
    TypeName = Literal[QUESTION_TYPES]  # a registered question type's name

IGNORED = ("other keys are ignored and named in the response's warnings; options.strict "
           "refuses them")


@dataclass(frozen=True)
class DocumentedAs:
    """Validate as the annotated type, show ``shown`` in the JSON Schema: the contract's shape of a
    field the parser checks itself, so that its errors keep the parser's names and order."""

    shown: Any

    def __get_pydantic_json_schema__(self, _schema: cs.CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        shown = handler(pydantic.TypeAdapter(self.shown).core_schema)
        # a Field(description=...) in ``shown``'s Annotated is the field's, not its type's: carry it
        for meta in getattr(self.shown, "__metadata__", ()):
            if isinstance(meta, FieldInfo) and meta.description:
                shown = {**shown, "description": meta.description}
        return shown


# ---------------------------------------------------------------- the contract, per question type
# Each registered type's request model (NoulQuestion, ChoiceQuestion, ...), generated from its entry in
# ``core.questions``: its criteria shown as its ``Criteria`` rule reads them.
def _fixed_criteria(entry: QuestionType) -> tuple[Any, Any]:
    fields: dict[str, Any] = {
        oid: (Any, Field(None, description=f"what {oid} means (default: the reference's)")) for oid, _ in entry.fixed}
    model = pydantic.create_model(
        f"{entry.name.capitalize()}Criteria",
        __config__=ConfigDict(extra="allow", json_schema_extra={"description": IGNORED}), **fields)
    return model | None, None


CRITERIA: dict[Criteria, Callable[[QuestionType], tuple[Any, Any]]] = {
    Criteria.FIXED: _fixed_criteria,
    Criteria.NAMED: lambda entry: (dict[str, Any], Field(min_length=1)),
    Criteria.LEVELS: lambda entry: (list[Any], Field(min_length=1)),
}
INSTRUCTIONS = "any JSON value (a string is used raw); the question id when missing, null or \"\""


def _question_model(entry: QuestionType) -> type[BaseModel]:
    first = entry is TYPES[0]
    return pydantic.create_model(
        f"{entry.name.capitalize()}Question", __config__=ConfigDict(extra="allow", title=entry.name),
        __doc__=entry.criteria_doc, type=(literal(entry.name), ...),
        instructions=(Any, Field(None, description=INSTRUCTIONS if first else f"as for {TYPES[0].name}")),
        criteria=CRITERIA[entry.criteria](entry))


def literal(*names: str) -> Any:
    """``Literal[names]`` of names known at run time (the registry's)."""
    return Literal.__getitem__(names)


QUESTION_MODELS = tuple(_question_model(entry) for entry in TYPES)
Question: Any = Annotated[Union[QUESTION_MODELS], Field(discriminator="type")]
Questions = Annotated[dict[str, Question], Field(
    min_length=1, description="question id -> question; order matters; options.strict: at most "
                              f"{MAX_QUESTIONS}")]


class Options(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"description": IGNORED})

    truncate_state: bool = Field(False, description="cut an over-long state to fit instead of "
                                                    "answering 413")
    strict: bool = Field(False, description="refuse what the reference ignores, apply the "
                                            "ecosystem's count limits")


class InlineImage(BaseModel):
    """avrik-sdk's image object: the same bytes as a data: URI."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="the image file's bytes, base64")
    media_type: str = Field("image/png", description="image/png, image/jpeg, image/gif or image/webp")


class Base64Image(BaseModel):
    """Workers AI's image object: the same bytes as a data: URI."""

    model_config = ConfigDict(extra="forbid")

    base64: str = Field(description="the image file's bytes, base64")
    content_type: str = Field("image/png", description="image/png, image/jpeg, image/gif or image/webp")


Images = Annotated[list[str | InlineImage | Base64Image] | None, Field(
    description="pictures: data: URIs or base64 (a path or URL only where the server was started with "
                "--media-allow-files / --media-allow-url); refused by a model without a vision tower")]
Videos = Annotated[list[str | list[list[str | InlineImage | Base64Image]]] | None, Field(
    description="videos, each a video file's path or URL (on a server only under --media-allow-files / "
                "--media-allow-url) or [[frame, ...]] (with media_kwargs.do_sample_frames false)")]



# ---------------------------------------------------------------- the request
class QuestionSpec(BaseModel):
    """One question as sent; other keys are kept aside to be named in ``warnings``."""

    model_config = ConfigDict(extra="allow")

    type: TypeName
    instructions: Any = None
    criteria: dict[str, Any] | list[Any] | None = None


class SystemOneRequest(BaseModel):
    """One SystemOne request; other keys are ignored and named in the response's warnings;
    options.strict refuses them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="echoed back")
    state: Any = Field(description="any JSON value; a string is used raw")
    questions: Annotated[dict[str, QuestionSpec], DocumentedAs(Questions)]
    options: Options | None = None
    images: Annotated[list[Any] | None, DocumentedAs(Images)] = None
    videos: Annotated[list[Any] | None, DocumentedAs(Videos)] = None
    calibration: Any = Field(None, description="a model served without --calibration ignores it (with a "
                                               "warning); with one, the loaded version or nothing, else "
                                               "422 wrong_calibration")
    media_kwargs: dict[str, Any] | None = Field(None, description="the processor's size, min_pixels, "
                                                "max_pixels, do_sample_frames, fps; other keys ignored")
    evidence: Any = Field(None, description="ours, opt-in: true or {\"top\": 1-32, \"mode\": \"attention\" "
                                            "| \"occlusion\", \"options\": bool, \"grid\": bool}: the state "
                                            "spans each answer's attention rested on (docs/evidence.md)")
