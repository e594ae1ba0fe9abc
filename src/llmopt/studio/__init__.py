"""The web studio: pages and a JSON API over the SDK, for people who would rather click than type.

    from llmopt.studio.app import serve
    serve()   # http://127.0.0.1:8765/?token=...

Everything it does, it does through `llmopt.sdk`; what it draws, `llmopt.presentation` draws.
"""
