/* labkit's explorers on a static page: step through the pictures drawn when the site was built.
   Each .lk-explorer holds its data (controls, frames in row-major order) in a JSON script element;
   this script adds a <select> or a range input per control, and swaps the picture and the summary. */
(function () {
  "use strict";

  function setUp(root) {
    var data = JSON.parse(root.querySelector("script.lk-explorer-data").textContent);
    var picture = root.querySelector("img.lk-explorer-picture");
    var summary = root.querySelector(".lk-explorer-summary");
    var holder = root.querySelector(".lk-explorer-controls");
    var sizes = data.controls.map(function (c) { return c.labels.length; });
    var index = [];
    var rest = data.opening;
    for (var k = sizes.length - 1; k >= 0; k--) { index[k] = rest % sizes[k]; rest = Math.floor(rest / sizes[k]); }
    var readouts = [];
    var inputs = [];

    function frame() {
      var flat = 0;
      for (var k = 0; k < sizes.length; k++) { flat = flat * sizes[k] + index[k]; }
      return data.frames[flat];
    }

    function show() {
      var current = frame();
      picture.src = "_explorers/" + current.picture + ".png";
      summary.innerHTML = current.summary;
      for (var k = 0; k < readouts.length; k++) {
        if (readouts[k]) { readouts[k].textContent = current.shown[k]; }
      }
      root.setAttribute("data-frame", current.picture);
    }

    data.controls.forEach(function (control, k) {
      var label = document.createElement("label");
      label.className = "lk-control";
      var name = document.createElement("span");
      name.className = "lk-control-name";
      name.textContent = control.description;
      label.appendChild(name);
      var input;
      if (control.kind === "range") {
        input = document.createElement("input");
        input.type = "range";
        input.min = 0;
        input.max = control.labels.length - 1;
        input.step = 1;
        input.value = index[k];
        var readout = document.createElement("output");
        readout.className = "lk-control-value";
        readouts[k] = readout;
        label.appendChild(input);
        label.appendChild(readout);
      } else {
        input = document.createElement("select");
        control.labels.forEach(function (text, j) {
          var option = document.createElement("option");
          option.value = j;
          option.textContent = text;
          input.appendChild(option);
        });
        input.value = index[k];
        label.appendChild(input);
      }
      input.setAttribute("aria-label", control.description);
      input.addEventListener("input", function () { index[k] = parseInt(input.value, 10); show(); });
      inputs.push(input);
      holder.appendChild(label);
    });
    show();
  }

  function start() {
    var explorers = document.querySelectorAll(".lk-explorer[data-key]");
    for (var i = 0; i < explorers.length; i++) { setUp(explorers[i]); }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
