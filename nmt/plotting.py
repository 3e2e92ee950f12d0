"""matplotlib, set up once to draw into files on a machine without a display: the model card's
validation curve, translate.py's attention maps, dev/plot_runs.py's pictures."""


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
