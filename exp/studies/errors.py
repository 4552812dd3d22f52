"""The one exception of the studies: input they cannot work with."""


class StudyError(Exception):
    """Input the study cannot work with; the message says what to change."""
