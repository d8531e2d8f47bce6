"""Anthropic's Messages API on the front: its schemas and translation to the chat request
(schemas.py), the chat answer translated back (anthropic_format.py), and the serving object
the routes call (serving_messages.py)."""
