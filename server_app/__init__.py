"""The fedcomp ServerApp (see server_app/app.py)."""
