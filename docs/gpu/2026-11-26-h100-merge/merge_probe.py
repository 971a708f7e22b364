import os,sys,torch,json,time
from dataclasses import replace as R
from peft import LoraConfig,get_peft_model
from bench import gpu_parts as g
from trl_dllm.training.rollouts import generate_rollouts as G
from trl_dllm.models import resolve_model_spec
from trl_dllm.seeding import device_generators as D
Q=len(sys.argv)>1
S=g.QUICK_SHAPES["llada"] if Q else g.SHAPES["llada"]
P=g.QUICK_RECIPE if Q else g.Recipe()
tok,m=g.build_model(S)
m=get_peft_model(m,LoraConfig(r=P.lora_r,lora_alpha=P.lora_alpha,lora_dropout=0.0,target_modules=["q_proj","k_proj","v_proj","up_proj"]))
for n,p in m.named_parameters():
  if "lora_B" in n:
    with torch.no_grad(): p.normal_(0,0.02/P.lora_r**.5)
o={"adapter_dtype":str(next(p.dtype for n,p in m.named_parameters() if "lora_A" in n)),"device":g.device().type}
steps=g.valid_steps(8,P.completion,P.block)
ids,mask=g.prompt_batch(tok,P)
spec=resolve_model_spec(m,tok)
def roll(T=0.9):
  a=g.rollout_config(P,diffusion_steps=steps,temperature=T)
  with torch.no_grad(): return G(m,spec,a,ids,mask,D(torch.arange(ids.size(0)),g.device()),eos_token_ids=[],return_trajectory=False).completion_ids
def t(f,n=2):
  f();s=g.clock()
  for _ in range(n): f()
  return round((g.clock()-s)/n/steps,5)
m.eval()
with m.disable_adapter(): o["adapters_off"]=t(roll)
o["adapters"]=t(roll);m.train();o["train_mode"]=t(roll);m.eval()
s=g.clock();m.merge_adapter();o["merge_s"]=round(g.clock()-s,4)
o["merged"]=t(roll)
s=g.clock();m.unmerge_adapter();o["unmerge_s"]=round(g.clock()-s,4)
W={n:p.detach().clone() for n,p in m.named_parameters() if "base_layer.weight" in n}
u=roll(0.0);m.merge_adapter();v=roll(0.0);m.unmerge_adapter()
o["t0_token_agreement"]=(u==v).float().mean().item()
def drift():
  d=[(p.detach()!=W[n]).sum().item() for n,p in m.named_parameters() if n in W]
  mx=max((p.detach().float()-W[n].float()).abs().max().item() for n,p in m.named_parameters() if n in W)
  return sum(d)/sum(w.numel() for w in W.values()),mx
for k in (1,10):
  for _ in range(k if k==1 else 9): m.merge_adapter();m.unmerge_adapter()
  o[f"changed_frac_{k}"],o[f"max_abs_{k}"]=drift()
o["weight_absmax"]=max(w.float().abs().max().item() for w in W.values())
for n,p in m.named_parameters():
  if "lora_" in n: p.data=p.data.to(g.dtype())
o["adapters_in_model_dtype"]=t(roll)
o["steps"]=steps
print("RESULT",json.dumps(o))
