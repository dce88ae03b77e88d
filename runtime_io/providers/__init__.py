"""The model providers an agent file can name: each implements :class:`runtime.provider.Provider`.

``scripted.py`` plays a JSON script; ``openai.py`` speaks OpenAI-compatible chat
completions over ``http.py``'s shared client; ``anthropic.py`` the Messages API;
``known.py`` builds the one an agent file's ``model`` names.
"""
