"""The question types of the SystemOne contract, in the order of the head's ``type_embedding`` rows
(the head, the request parser and the calibration file all index this one tuple), and the counts
``strict`` enforces (the limits Jev and its clients enforce, not the reference's)."""

QUESTION_TYPES = ("noul", "choice", "score")
TYPE_INDEX = {name: i for i, name in enumerate(QUESTION_TYPES)}  # row of type_embedding

MAX_QUESTIONS = 64
CHOICE_OPTIONS = (2, 255)
SCORE_LEVELS = (2, 10)
