"""OpenAI's Files and Batch API: uploaded files and batch jobs stored durably (SQLite plus a files directory), run
in the background of live traffic, and resumed where they stopped after a restart."""
