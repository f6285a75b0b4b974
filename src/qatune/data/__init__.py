"""Data: spreadsheets -> QA records -> model tensors."""
