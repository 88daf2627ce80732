"""A reward for tests on the random tiny-llama: it differs between completions of one prompt (a
real advantage signal) and depends only on the sampled ids."""


def ids_mod_5(completion_ids, **_):
    return [float(sum(ids) % 5) for ids in completion_ids]
