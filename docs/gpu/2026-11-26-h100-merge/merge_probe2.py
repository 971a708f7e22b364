import sys,torch,json,contextlib
from peft import LoraConfig,get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from bench import gpu_parts as g
from trl_dllm.training.rollouts import generate_rollouts as G
from trl_dllm.models import resolve_model_spec
from trl_dllm.seeding import device_generators as D
@contextlib.contextmanager
def merged_adapters(model):  # trl_dllm.training.rollouts.merged_adapters (branch rollout-merge), copied
    kept=[]
    for layer in model.modules():
        if isinstance(layer,BaseTunerLayer) and not layer.merged:
            w=layer.get_base_layer().weight; kept.append((w,w.data)); w.data=w.data.clone()
    model.merge_adapter()
    try: yield model
    finally:
        model.unmerge_adapter()
        for w,d in kept: w.data=d
Q=len(sys.argv)>1
S=g.QUICK_SHAPES["llada"] if Q else g.SHAPES["llada"]
P=g.QUICK_RECIPE if Q else g.Recipe()
tok,m=g.build_model(S)
m=get_peft_model(m,LoraConfig(r=P.lora_r,lora_alpha=P.lora_alpha,lora_dropout=0.0,target_modules=["q_proj","k_proj","v_proj","up_proj"])).eval()
for n,p in m.named_parameters():
  if "lora_B" in n:
    with torch.no_grad(): p.normal_(0,0.02/P.lora_r**.5)
steps=g.valid_steps(8,P.completion,P.block);ids,mask=g.prompt_batch(tok,P);spec=resolve_model_spec(m,tok)
def roll(T=0.9):
  a=g.rollout_config(P,diffusion_steps=steps,temperature=T)
  with torch.no_grad(): return G(m,spec,a,ids,mask,D(torch.arange(ids.size(0)),g.device()),eos_token_ids=[],return_trajectory=False).completion_ids
W={n:p.detach().clone() for n,p in m.named_parameters() if "lora_" not in n}
o={"steps":steps};roll()
def ctx():
  with merged_adapters(m): roll()
for name,f in (("unmerged",roll),("merged_adapters",ctx)):
  f();g.reset_peak(forget=True);b=g.memory();s=g.clock();f();o[name+"_s_per_step"]=round((g.clock()-s)/steps,5);o[name+"_peak"]=g.memory()
s=g.clock()
with merged_adapters(m): o["enter_s"]=round(g.clock()-s,4);s=g.clock()
o["exit_s"]=round(g.clock()-s,4)
o["restored_bit_for_bit"]=all(torch.equal(p,W[n]) for n,p in m.named_parameters() if n in W)
print("RESULT",json.dumps(o))
