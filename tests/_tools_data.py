"""Tools the tool-calling tests ask for (tests/test_serve_tools.py, tests/test_tool_parsers.py)."""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"type": "string", "enum": ["C", "F"]}}}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["on"],
                   "properties": {"on": {"type": "boolean"}}}}}
TOOLS = [WEATHER, ALARM]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
