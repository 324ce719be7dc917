"""The fedcomp ClientApp (see client_app/app.py)."""
