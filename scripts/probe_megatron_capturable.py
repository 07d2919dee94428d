"""Why does megatron's own optimizer train differently with ``optimizer_cuda_graph=True``?

Three identical megatron-core GPT models (tiny, fp32) train on the same batches: megatron's
default optimizer, ``OptimizerConfig(optimizer_cuda_graph=True)`` (capturable inner AdamW), and
the default one made graph-safe by ``tgraph.integrations.megatron.make_graph_safe``. After each of
the first steps the script compares parameters and optimizer state across the three and prints the
first place they part, with the inner optimizers' settings.

    python scripts/probe_megatron_capturable.py --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    p.add_argument("--out", default="probe_megatron_capturable.json")
    a = p.parse_args()

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tgraph.integrations import megatron as tm

    tm.init_single_gpu()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 1024, (8, 129), generator=g).cuda() for _ in range(a.batches)]
    runs = {}
    for name in ("default", "default_one_ulp", "optimizer_cuda_graph", "make_graph_safe"):
        model = tm.build_gpt(
            num_layers=a.layers,
            hidden_size=256,
            num_attention_heads=4,
            vocab_size=1024,
            seq_length=128,
        )
        mopt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=1e-3, optimizer_cuda_graph=name == "optimizer_cuda_graph"
            ),
            [model],
        )
        if name == "make_graph_safe":
            tm.make_graph_safe(mopt)
        if name == "default_one_ulp":  # the chaos baseline: one weight moved by one ulp
            w = next(p for p in model.parameters() if p.dim() == 2)
            with torch.no_grad():
                w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")).cuda())
        runs[name] = (model, mopt)

    def inner(mopt):
        subs = getattr(mopt, "chained_optimizers", [mopt])
        return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]

    settings = {
        name: [
            [
                {k: repr(v) for k, v in grp.items() if k != "params"}
                | {"n_params": len(grp["params"]), "type": type(o).__name__}
                for grp in o.param_groups
            ]
            for o in inner(mopt)
        ]
        for name, (_, mopt) in runs.items()
    }
    rows = []
    for step in range(a.steps):
        tokens = batches[step % len(batches)]
        losses, norms = {}, {}
        for name, (model, mopt) in runs.items():
            mopt.zero_grad()
            loss = tm.forward_backward(model, [(tokens[:, :-1], tokens[:, 1:])])
            out = mopt.step()
            losses[name] = loss.item()
            norms[name] = [
                float(x) if isinstance(x, (int, float, torch.Tensor)) else repr(x)
                for x in (out if isinstance(out, tuple) else (out,))
            ]
        ref = dict(runs["default"][0].named_parameters())
        diffs = {}
        for name, (model, _) in runs.items():
            if name == "default":
                continue
            worst = (0.0, "")
            for pn, prm in model.named_parameters():
                d = (prm.detach() - ref[pn].detach()).abs().max().item()
                scale = ref[pn].detach().abs().max().item() or 1.0
                if d / scale > worst[0]:
                    worst = (d / scale, pn)
            diffs[name] = {"max_rel_param_diff": worst[0], "where": worst[1]}
        states = {}
        for name, (_, mopt) in runs.items():
            st = [s for o in inner(mopt) for s in o.state.values()]
            steps = {repr(s.get("step")) for s in st[:3]}
            states[name] = {"n_state": len(st), "steps_first3": sorted(steps)}
        row = {
            "step": step,
            "loss": losses,
            "step_returns": norms,
            "diff_vs_default": diffs,
            "state": states,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump({"torch": torch.__version__, "settings": settings, "rows": rows}, f, indent=1)
    print(json.dumps(settings, indent=1))


if __name__ == "__main__":
    main()
