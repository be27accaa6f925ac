"""The mixture-of-experts layer on one process: routing, dispatch, grouped GEMM against the
per-expert loop, capacity, the balance term and the balancing bias, each against a reference
computed token by token."""

import math

import pytest
import torch
import torch.nn.functional as F

from torchpar import loss
from torchpar.models import MODELS
from torchpar.models.common import SwiGLU
from torchpar.models.moe import MoE, Router, balance_loss, grouped_mm_problem, update_bias

MOE_FAMILY = MODELS["moe"]
DEEPSEEK = MODELS["deepseek_v3"]


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(dim=16, hidden=32, experts=4, top_k=2)
    return MoE(**{**args, **kw})


def expert_reference(ex, x: torch.Tensor, j: int) -> torch.Tensor:
    """Expert ``j`` on one token: SwiGLU, or with biases and a limit gpt-oss's form (the gate
    clamped above, the up projection both ways, gate x sigmoid(1.702 gate) x (up + 1))."""
    gate, up = x @ ex.w1[j], x @ ex.w3[j]
    if ex.w1_bias is not None:
        gate, up = gate + ex.w1_bias[j], up + ex.w3_bias[j]
    if ex.limit:
        gate, up = gate.clamp(max=ex.limit), up.clamp(min=-ex.limit, max=ex.limit)
        hidden = gate * torch.sigmoid(1.702 * gate) * (up + 1)
    else:
        hidden = F.silu(gate) * up
    return hidden @ ex.w2[j] + (ex.w2_bias[j] if ex.w2_bias is not None else 0)


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its chosen experts (and the shared ones)."""
    x2 = x.reshape(-1, x.shape[-1])
    weights, chosen, _ = moe.router(x2)
    out = []
    for i in range(x2.shape[0]):
        y = torch.zeros(x2.shape[1])
        for w, j in zip(weights[i], chosen[i].tolist()):
            y = y + w * expert_reference(moe.experts, x2[i], j)
        out.append(y + (moe.shared(x2[i]) if moe.shared is not None else 0))
    return torch.stack(out).view(x.shape)


def with_biases(moe: MoE) -> MoE:
    """Non-zero biases on the router and the experts (they start at zero), the clamp reached."""
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "experts.w" in name:
                p.mul_(200)  # (pre-activations beyond the limit of 7 in places)
    return moe


GPT_OSS = {"biases": True, "limit": 7.0}


@pytest.mark.parametrize("kw", [{}, {"shared_hidden": 24}, {"score": "sigmoid", "normalize": False,
                                                              "route_scale": 2.5}, GPT_OSS])
def test_dropless_layer_equals_the_token_by_token_reference(kw):
    moe = with_biases(layer(**kw)) if kw.get("biases") else layer(**kw)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-4, atol=1e-5)
    assert moe.loads.sum() == 0  # outside a training step (evaluation, generation): nothing counted
    with loss.auxiliary_terms((), scale=1.0):
        moe(x)
    assert moe.loads.sum() == 3 * 5 * 2 and moe.dropped == 0


@pytest.mark.parametrize("kw", [{}, GPT_OSS])
def test_grouped_gemm_equals_the_per_expert_loop_forward_and_backward(kw):
    moe = with_biases(layer(**kw)) if kw else layer()
    x = torch.randn(40, 16)
    counts = torch.tensor([0, 17, 3, 20])  # an expert without rows, uneven others
    outs, grads = [], []
    for grouped in (True, False):
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        y = moe.experts(xi, counts, grouped)
        y.backward(torch.ones_like(y))
        outs.append(y)
        grads.append([xi.grad] + [p.grad.clone() for p in moe.experts.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_gemm_says_why_it_cannot_run(monkeypatch):
    assert grouped_mm_problem(torch.float32, torch.device("cpu"), 16, 32) is None
    assert "10 x 4 bytes" in grouped_mm_problem(torch.float32, torch.device("cpu"), 10, 32)
    assert "bfloat16" in grouped_mm_problem(torch.float32, torch.device("cuda"), 16, 32)
    # torch's kernel sets its groups up in one block of 1024 threads, and reads rows from 16-byte
    # boundaries: an operand starting 4 bytes in (a view into a larger buffer) takes the loop
    assert "1024 experts on a rank" in grouped_mm_problem(torch.bfloat16, torch.device("cpu"), 16, 32,
                                                          groups=1024)
    buffer = torch.zeros(1 + 4 * 16)
    aligned, shifted = buffer[:64].view(4, 16), buffer[1:].view(4, 16)
    assert grouped_mm_problem(torch.float32, torch.device("cpu"), 16, tensors=(aligned,)) is None
    assert "address" in grouped_mm_problem(torch.float32, torch.device("cpu"), 16, tensors=(shifted,))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))  # a V100
    assert "capability 8.0" in grouped_mm_problem(torch.bfloat16, torch.device("cuda"), 16, 32)
    moe = layer(dim=10)  # fp32 rows of 40 bytes: the loop, still equal to the reference
    assert moe.how(torch.float32, torch.device("cpu")).startswith("a loop over the experts")
    x = torch.randn(7, 10)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_the_bias_steers_the_choice_not_the_weight():
    router = Router(dim=4, experts=4, top_k=2)
    with torch.no_grad():
        router.gate.weight.zero_()  # every score equal: a four-way tie
    weights, chosen, scores = router(torch.randn(3, 4))
    assert chosen.tolist() == [[0, 1]] * 3
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.5]))
    weights, chosen, scores = router(torch.randn(3, 4))
    assert chosen.tolist() == [[2, 3]] * 3
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))  # the scores, normalized: no bias in them


def test_group_limited_routing_chooses_within_the_best_groups_token_by_token():
    """route_groups: each token's experts come from the route_top_groups groups of consecutive
    experts whose two best scores (with the bias) sum highest; written out token by token, with the
    bias steering the groups too. One group is plain top-k routing."""
    torch.manual_seed(0)
    router = Router(dim=16, experts=8, top_k=3, score="sigmoid", groups=4, top_groups=2)
    router.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(64, 16)
    weights, chosen, scores = router(x)
    choice = scores + router.expert_bias
    for i in range(64):
        worth = [sorted(choice[i, 2 * g: 2 * g + 2].tolist())[-2:] for g in range(4)]
        best = sorted(range(4), key=lambda g: -sum(worth[g]))[:2]
        allowed = [j for g in sorted(best) for j in (2 * g, 2 * g + 1)]
        want = sorted(allowed, key=lambda j: -choice[i, j].item())[:3]
        assert chosen[i].tolist() == want, i
        assert {j // 2 for j in chosen[i].tolist()} <= set(best)
    plain = Router(dim=16, experts=8, top_k=3, score="sigmoid")
    plain.load_state_dict(router.state_dict())
    plain.expert_bias.copy_(router.expert_bias)
    grouped_as_one = Router(dim=16, experts=8, top_k=3, score="sigmoid", groups=1, top_groups=1)
    grouped_as_one.load_state_dict(router.state_dict())
    grouped_as_one.expert_bias.copy_(router.expert_bias)
    assert torch.equal(plain(x)[1], grouped_as_one(x)[1])
    assert not torch.equal(plain(x)[1], chosen)  # (the groups changed some token's choice)


def test_group_limited_routing_logs_the_groups_each_token_reaches():
    """With route_groups the step's figures add moe/groups_per_token: between 1 and
    route_top_groups on average, exactly 1 when each token keeps one group."""
    for top, low, high in ((2, 1.0, 2.0), (1, 1.0, 1.0)):
        args = DEEPSEEK.args("debug", route_top_groups=top)
        model = DEEPSEEK.build(args)
        model.init_weights(0)
        routing = DEEPSEEK.routing([model], args)
        assert routing.names[-1] == "moe/groups_per_token"
        with loss.auxiliary_terms((), scale=1.0):
            model(torch.randint(0, args.vocab_size, (2, 8)))
        reached = routing.update(routing.take())[-1].item()
        assert low <= reached <= high and (top == 1 or reached > 1), (top, reached)
    assert "moe/groups_per_token" not in MOE_FAMILY.routing([model], MOE_FAMILY.args("debug")).names


def test_capacity_drops_the_latest_tokens_of_a_full_expert():
    moe = layer(capacity_factor=0.5)
    with torch.no_grad():  # every token prefers experts 0 and 1 (a large bias on them)
        moe.router.expert_bias.copy_(torch.tensor([10.0, 9.0, 0.0, 0.0]))
    x = torch.randn(8, 16)
    with loss.auxiliary_terms((), scale=1.0):
        y = moe(x)
    capacity = math.ceil(0.5 * 8 * 2 / 4)  # 2 slots per expert
    assert moe.loads.tolist() == [capacity, capacity, 0, 0] and moe.dropped == 16 - 2 * capacity
    kept = reference(moe, x[:capacity])  # the first two tokens keep both experts
    torch.testing.assert_close(y[:capacity], kept, rtol=1e-5, atol=1e-6)
    assert y[capacity:].abs().max() == 0  # the rest were dropped by both of theirs (and no shared expert)


def test_balance_term_is_one_when_balanced_and_joins_the_loss():
    scores = torch.full((1, 8, 4), 0.25)
    assert balance_loss(scores, torch.arange(8).view(1, 8) % 4, 4).item() == pytest.approx(1.0)
    assert balance_loss(scores, torch.zeros(1, 8, dtype=torch.long), 4).item() == pytest.approx(1.0)
    skewed = torch.tensor([[[1.0, 0, 0, 0]] * 8])
    assert balance_loss(skewed, torch.zeros(1, 8, dtype=torch.long), 4).item() == pytest.approx(4.0)
    # Two sequences, each its own: one balanced, one skewed (not the 2.5 of their pooled counts).
    slots = torch.stack([torch.arange(8) % 4, torch.zeros(8).long()])
    two = balance_loss(torch.cat([scores, skewed]), slots, 4)
    assert two.tolist() == pytest.approx([1.0, 4.0])
    moe = layer(balance_coeff=0.01)
    x = torch.randn(2, 3, 16)  # two sequences of three tokens
    with loss.auxiliary_terms((loss.Z_LOSS, "balance"), scale=1.0) as terms:
        moe(x).sum().backward()
    assert terms.sums["balance"] > 0 and moe.router.gate.weight.grad is not None
    # The sum over sequences: the same whether they come in one forward or one by one.
    _, chosen, scores = moe.router(x.view(6, 16))
    scores, chosen = scores.view(2, 3, 4), chosen.reshape(2, 6)
    per_sequence = [balance_loss(scores[i:i + 1], chosen[i:i + 1], 4) for i in (0, 1)]
    torch.testing.assert_close(terms.sums["balance"], 0.01 * 3 * sum(per_sequence).squeeze().detach())


def test_bias_moves_toward_the_mean_load():
    bias = update_bias(torch.zeros(4), torch.tensor([10.0, 2.0, 4.0, 4.0]), rate=1e-3)
    assert bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3])
    assert update_bias(torch.zeros(2), torch.tensor([3.0, 3.0]), 1e-3).tolist() == [0.0, 0.0]


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k = 5 must be between 1 and the 4 experts"):
        Router(dim=4, experts=4, top_k=5)


# ---------------------------------------------------------------- the family


def test_stage_params_match_the_built_model_for_dense_and_routed_blocks():
    """The planner's table (expert stacks as (experts, rest)) names every parameter of every
    block, the first dense one included, with its element count; the counts add up."""
    for family, flavor in ((MOE_FAMILY, "debug"), (DEEPSEEK, "debug"), (MODELS["gpt_oss"], "debug")):
        args = family.args(flavor)
        model = family.build(args)
        real = [(n, p.numel()) for n, p in model.named_parameters()]
        table = family.stage_params(args, True, True, range(args.n_layers))
        assert [(n.split(".", 2)[-1] if n.startswith("layers.") else n, c) for n, c in real] == \
            [(n, r * c) for n, (r, c), _ in table]
        assert family.num_params(args) == sum(c for _, c in real)
        assert isinstance(model.layers["0"].feed_forward, SwiGLU) == (args.dense_layers == 1)
        assert all(isinstance(model.layers[str(i)].feed_forward, MoE) for i in range(1, args.n_layers))


def test_flops_count_the_active_experts_only():
    args = MOE_FAMILY.args("debug")
    dense = MOE_FAMILY.flops_per_token(args, 32)
    more = MOE_FAMILY.args("debug", experts=16)  # twice the experts, the same k: only the router grows
    routers = 3 * 2 * args.dim * 8 * len(args.moe_layers)  # 8 more gate rows per routed block
    assert MOE_FAMILY.flops_per_token(more, 32) - dense == routers
    assert MOE_FAMILY.num_params(more) > MOE_FAMILY.num_params(args)
    wider = MOE_FAMILY.args("debug", top_k=4)  # k from 2 to 4: 3 x 2 x d x h more per routed block and token
    extra = 3 * 2 * 3 * args.dim * args.moe_hidden * 2 * len(args.moe_layers)
    assert MOE_FAMILY.flops_per_token(wider, 32) - dense == extra


def test_routing_sums_loads_moves_the_bias_and_saves_it():
    args = MOE_FAMILY.args("debug", bias_rate=0.5)
    model = MOE_FAMILY.build(args)
    model.init_weights(0)
    routing = MOE_FAMILY.routing([model], args)
    with loss.auxiliary_terms((), scale=1.0):
        model(torch.randint(0, args.vocab_size, (2, 8)))
    counts = routing.take()
    rows, e = counts.view(len(args.moe_layers), -1), args.experts
    assert rows[:, :e].sum(1).tolist() == [2 * 8 * 2] * 3 and rows[:, e:].tolist() == [[0, 0]] * 3
    assert routing.take().sum() == 0  # the counters restart
    max_load, dropped, bias_range = routing.update(2 * counts)  # (as if two ranks saw the same)
    loads = rows[:, :e]
    assert max_load == (loads.max(1).values / loads.mean(1)).max() and dropped == 0
    expected = 0.5 * torch.sign(loads.mean(1, keepdim=True) - loads)
    torch.testing.assert_close(routing.bias, expected)
    assert bias_range == expected.max() - expected.min()
    torch.testing.assert_close(model.layers["2"].feed_forward.router.expert_bias, expected[1])
    other = MOE_FAMILY.build(args)
    MOE_FAMILY.routing([other], args).load_state_dict(routing.state_dict())
    torch.testing.assert_close(other.layers["3"].feed_forward.router.expert_bias, expected[2])


def test_the_planner_traces_a_routed_block_on_the_meta_device():
    from torchpar.plan.activations import traced

    held = traced(MOE_FAMILY, MOE_FAMILY.args("debug"), "none", torch.float32, 2, 16)
    assert held["block"] and held["rest"]


def test_moe_shapes_and_layouts_are_refused_in_one_line():
    with pytest.raises(ValueError, match="model.top_k = 9 must be between 1 and model.experts = 8"):
        MOE_FAMILY.args("debug", top_k=9)
    with pytest.raises(ValueError, match="does not apply to the llama3 family"):
        MODELS["llama3"].args("debug", experts=4)
    for groups, top in ((3, 1), (4, 5), (8, 1)):  # (not dividing 8 experts; more than there are; too few)
        with pytest.raises(ValueError, match=f"route_groups = {groups} with model.route_top_groups = {top}"):
            MOE_FAMILY.args("debug", route_groups=groups, route_top_groups=top)
    assert MOE_FAMILY.sequence_terms(MOE_FAMILY.args("debug", balance_coeff=0.01, capacity_factor=1.0)) == (
        "capacity_factor", "balance_coeff")
    assert MOE_FAMILY.sequence_terms(MOE_FAMILY.args("debug")) == ()


def test_the_search_leaves_out_what_the_family_refuses():
    """Auto layouts never propose what the trainer would refuse: cp with a per-sequence term."""
    from torchpar.plan.layout import PRESETS
    from torchpar.plan.search import search

    cluster = PRESETS["H100-80GB"]  # one node of 8
    plans = search(MOE_FAMILY, MOE_FAMILY.args("debug", balance_coeff=0.01), cluster, 64, 256)
    assert plans and all(p.layout["cp"] == 1 for p in plans) and any(p.layout["tp"] > 1 for p in plans)
    free = search(MOE_FAMILY, MOE_FAMILY.args("debug"), cluster, 64, 256)
    assert any(p.layout["cp"] > 1 for p in free)


@pytest.mark.slow
def test_the_search_offers_expert_parallelism_and_it_wins_where_gathering_every_expert_is_exposed():
    """Qwen3-30B-A3B on one node of 8 H200s, 16 sequences of 4k: the search tries ep 2, 4 and 8 with
    ZeRO-3 (each rank gathers its experts only, over fewer ranks, and sends its rows by all-to-all);
    the same layout at ep 1 gathers all 128 experts of a block over 8 ranks, which the step cannot
    hide, and is predicted at half the throughput; the best layout is expert-parallel. A dense
    model is offered no ep."""
    from torchpar.plan.layout import PRESETS
    from torchpar.plan.search import describe_layout, search

    cluster = PRESETS["H200-141GB"]
    plans = search(MOE_FAMILY, MOE_FAMILY.args("qwen3-30B-A3B"), cluster, 16, 4096)
    best = next(p for p in plans if p.fits)
    assert best.layout["ep"] > 1 and f"ep {best.layout['ep']}" in describe_layout(best.layout)
    twins = {p.layout["ep"]: p for p in plans
             if all(p.layout[k] == best.layout[k] for k in best.layout if k != "ep")}
    assert sorted(twins) == [1, 2, 4, 8], sorted(twins)
    assert twins[1].tokens_per_sec < 0.6 * best.tokens_per_sec
    assert "ep" not in twins[1].communication and twins[8].communication["ep"]["bytes"] > 0
    assert twins[8].memory["gathered_bytes"] < twins[1].memory["gathered_bytes"]
    dense = search(MODELS["llama3"], MODELS["llama3"].args("1B"), cluster, 16, 4096)
    assert all(p.layout["ep"] == 1 for p in dense)
