"""The standalone aggregator: ``gunicorn -c python:app.gunicorn_conf app:wsgi`` (or ``python -m app serve``).

``hooks``: the master's owner election (gunicorn's hooks); ``settings``: the checks of its settings;
``wsgi``: the app its workers serve.  Never imports a rank's code (app.rank).
"""
