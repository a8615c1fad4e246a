"""The contract note itself: charges in Decimal, the note's content, the PDF from Typst.
Pure functions of an account's data: no Redis, no storage, no Ray."""
