"""The SystemOne request on the wire, as one pydantic model: the parser (``pipeline.request``) validates
a body with it, and ``/openapi.json`` shows it.

Validation is the reference's, lenient: any JSON state, a question's type checked and its criteria
left to the parser (which names each error by field, in its own order), other keys kept aside to be
named in ``warnings``. The document shows the contract per question type (``DocumentedAs``); it never
refuses a body the parser accepts. What JSON Schema cannot say (lone surrogates, prompts too long for
the window, instructions that render to no tokens) is refused by the parser only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema as cs

from clef_gguf.core.questions import MAX_QUESTIONS

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
class NoulCriteria(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"description": IGNORED})

    true: Any = Field(None, description="what true means (default: the reference's)")
    false: Any = Field(None, description="what false means (default: the reference's)")


class NoulQuestion(BaseModel):
    """criteria: optional descriptions of the answers true and false"""

    model_config = ConfigDict(extra="allow", title="noul")

    type: Literal["noul"]
    instructions: Any = Field(None, description="any JSON value (a string is used raw); the "
                                                "question id when missing, null or \"\"")
    criteria: NoulCriteria | None = None


class ChoiceQuestion(BaseModel):
    """criteria: option id -> description (any JSON value), reported in request order;
    options.strict: 2-255 options"""

    model_config = ConfigDict(extra="allow", title="choice")

    type: Literal["choice"]
    instructions: Any = Field(None, description="as for noul")
    criteria: dict[str, Any] = Field(min_length=1)


class ScoreQuestion(BaseModel):
    """criteria: level descriptions, lowest first; options.strict: 2-10 levels"""

    model_config = ConfigDict(extra="allow", title="score")

    type: Literal["score"]
    instructions: Any = Field(None, description="as for noul")
    criteria: list[Any] = Field(min_length=1)


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]
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

    type: Literal["noul", "choice", "score"]
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
