(function(){
"use strict";
function formatBytes(n){
  if(typeof n!=="number"||!isFinite(n))return "?";
  var sign=n<0?"-":"";n=Math.abs(n);
  var units=["bytes","KiB","MiB","GiB","TiB"];
  for(var i=0;i<units.length;i++){
    if(n<1024||i===units.length-1){return i===0?sign+Math.floor(n)+" bytes":sign+n.toFixed(2)+" "+units[i];}
    n/=1024;
  }
}
function copyText(text,button){
  function done(){button.textContent="Copied";button.classList.add("done");
    setTimeout(function(){button.textContent="Copy";button.classList.remove("done");},1500);}
  function fallback(){
    var area=document.createElement("textarea");area.value=text;area.setAttribute("readonly","");
    area.style.position="fixed";area.style.opacity="0";document.body.appendChild(area);area.select();
    try{document.execCommand("copy");done();}catch(e){}
    document.body.removeChild(area);
  }
  if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(text).then(done,fallback);}
  else{fallback();}
}
var buttons=document.querySelectorAll("button.copy");
for(var i=0;i<buttons.length;i++){
  buttons[i].addEventListener("click",function(event){
    var target=document.getElementById(event.currentTarget.getAttribute("data-copy"));
    if(target){copyText(target.textContent,event.currentTarget);}
  });
}
var dataNode=document.getElementById("timeline-data");
var svg=document.getElementById("timeline-svg");
if(dataNode&&svg){
  var data=JSON.parse(dataNode.textContent);
  var tooltip=document.getElementById("tooltip");
  var guide=document.getElementById("hover-line");
  var points=data.allocated;
  var ends=data.end;
  var nearest=function(series,x){
    var lo=0,hi=series.length-1;
    if(hi<0)return null;
    while(hi-lo>1){var mid=(lo+hi)>>1;if(series[mid][0]<x)lo=mid;else hi=mid;}
    return Math.abs(series[lo][0]-x)<=Math.abs(series[hi][0]-x)?series[lo]:series[hi];
  };
  svg.addEventListener("mousemove",function(event){
    var box=svg.getBoundingClientRect();
    var vx=(event.clientX-box.left)/box.width*data.width;
    var x=data.xMin+(vx-data.left)/data.plotW*(data.xMax-data.xMin);
    var point=nearest(points,x);
    if(!point){return;}
    var px=data.left+(point[0]-data.xMin)/(data.xMax-data.xMin)*data.plotW;
    guide.setAttribute("x1",px);guide.setAttribute("x2",px);guide.setAttribute("visibility","visible");
    var lines=["step "+point[2]+", "+point[3],"allocated "+formatBytes(point[1])];
    var end=nearest(ends,x);
    if(end&&end[2]===point[2]){lines.push("end of step "+formatBytes(end[1]));}
    var reserved=nearest(data.reserved,x);
    if(reserved&&reserved[2]===point[2]){lines.push("reserved "+formatBytes(reserved[1]));}
    tooltip.textContent=lines.join("\n");
    tooltip.hidden=false;
    var left=px/data.width*box.width+12;
    if(left>box.width-170){left-=190;}
    tooltip.style.left=left+"px";tooltip.style.top=(event.clientY-box.top+12)+"px";
  });
  svg.addEventListener("mouseleave",function(){tooltip.hidden=true;guide.setAttribute("visibility","hidden");});
}
document.body.setAttribute("data-script-ms",performance.now().toFixed(1));
window.addEventListener("load",function(){
  document.body.setAttribute("data-loaded-ms",performance.now().toFixed(1));
  /* Reading a size forces style and layout of the whole page: rendered but for painting. */
  document.body.getBoundingClientRect();
  document.body.setAttribute("data-rendered-ms",performance.now().toFixed(1));
  requestAnimationFrame(function(){document.body.setAttribute("data-painted-ms",performance.now().toFixed(1));});
});
})();
