"""qatune: turn a spreadsheet of questions and answers into a fine-tuned QA model."""

__version__ = "0.1.0"
